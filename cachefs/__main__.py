from cachefs.cli import main

raise SystemExit(main())
