"""cachefs-operator: the Dataset resource (``datasets.cachefs.io``) made real on a cluster.

Why here, in ``csi_driver``, and not in ``cachefs/operator``: the operator is Kubernetes glue of the
same kind as the CSI driver. What it creates is a PersistentVolume that the driver mounts, so it
must accept exactly the volume attributes the driver accepts: it checks a Dataset's spec with the
driver's own parser (``csi_driver.attributes``), which the layers contract
(``csi_driver -> cachefs -> tiering``) would forbid from ``cachefs``. Like the rest of
``csi_driver`` it reaches cachefs only through the ``cachefs prefetch`` command its Jobs run; it
imports neither the daemon, the FUSE adapter nor the filesystem (import-linter checks it).

Layout, outermost first:

``main``       the ``cachefs-operator`` entry point: flags, the kubernetes client's configuration,
               ``kopf.run``.
``handlers``   the kopf handlers, registered in a registry built per operator (tests build their
               own): Dataset create/update/resume, delete (a finalizer), a timer that follows warm-up
               Jobs into status and starts scheduled runs, a timer that releases gated pods, a
               timer that reads the volume's mount pods into ``status.usage``.
``kube``       the kubernetes client where kopf leaves off: create PVs, PVCs and Jobs, list them by
               label, read a pod's log, delete what the operator made.
``manifests``  pure builders of the objects (PersistentVolume, PersistentVolumeClaim, Job) and of
               the status (progress per tier, conditions) from the warm-up Jobs' JSON lines.
``usage``      what a Dataset saved: its mount pods' /stats read over HTTP, added up across
               operator and mount pod restarts, hit ratios, source bytes and requests avoided, cost.
``spec``       a Dataset's spec parsed into frozen ``DatasetSettings``, or ``SpecError`` naming the
               problem.
``cron``       the five-field schedule of ``warmUp.schedule.cron`` (croniter), in UTC or ``timeZone``.

Progress: a warm-up Job runs ``cachefs prefetch MOUNT ... --json-progress``, which prints the job
document of the cachefs daemon as one JSON line every few seconds and the final one last. The
operator reads the last lines of the Job's pod log on each follow tick (the log outlives the
container, so a finished Job's final document is read the same way), and the Job's own status says
whether it succeeded. Nothing in the Job needs credentials for the Kubernetes API: the pod only
prints, the operator reads.
"""
