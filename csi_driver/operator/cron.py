"""``warmUp.schedule.cron``: a five-field cron schedule, read by croniter, in UTC or a named time zone.

The operator asks one question of a schedule: "did a scheduled minute pass between the last run's
start and now?" (``Cron.due``). croniter answers it with the meaning cron users expect: numbers,
``*``, ranges ``a-b``, lists, steps ``*/n`` and ``a-b/n``, month and day names (``jan``, ``mon-fri``),
day-of-week 0-7 (0 and 7 Sunday), and, when both day fields are restricted, either one matching
(Vixie cron). Exactly five fields: croniter would take a sixth (seconds) or a seventh (years),
which no crontab has, and the ``@daily`` shorthands, which the CRD's pattern keeps out.

``timeZone`` (as a CronJob's ``spec.timeZone``): an IANA name such as ``Europe/Paris``; the
schedule's minutes are that zone's wall clock, daylight-saving jumps as croniter handles them (a
02:30 that does not exist on the spring-forward day fires at the first minute after the jump).
Without one, UTC.

Every refusal is one line naming the problem (``CronError``), never croniter's exception.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from dataclasses import dataclass

from croniter import croniter
from croniter.croniter import CroniterError

FIELDS = 5


class CronError(ValueError):
    """A schedule or time zone that cannot be used; the message is one line."""


@dataclass(frozen=True)
class Cron:
    expression: str
    zone: dt.tzinfo = dt.timezone.utc

    def next_after(self, when: dt.datetime) -> dt.datetime:
        """The first scheduled minute strictly after ``when`` (aware), in the schedule's zone."""
        nxt = croniter(self.expression, when.astimezone(self.zone)).get_next(dt.datetime)
        assert isinstance(nxt, dt.datetime)
        return nxt

    def matches(self, when: dt.datetime) -> bool:
        """Whether the minute of ``when`` is a scheduled one."""
        minute = when.replace(second=0, microsecond=0)
        return self.next_after(minute - dt.timedelta(seconds=1)) == minute.astimezone(self.zone)

    def due(self, since: dt.datetime, now: dt.datetime) -> bool:
        """Whether a scheduled minute lies in ``(since, now]`` (both aware, any zone); the minute
        ``since`` falls in does not count again."""
        start = since.replace(second=0, microsecond=0)
        return self.next_after(start) <= now


def parse_cron(text: str, time_zone: str | None = None) -> Cron:
    """``Cron`` for a five-field schedule in ``time_zone`` (None: UTC); ``CronError`` otherwise."""
    fields = text.split()
    if len(fields) != FIELDS:
        raise CronError(f"cron schedule {text!r} must have five fields: minute hour day-of-month month day-of-week")
    zone: dt.tzinfo = dt.timezone.utc
    if time_zone is not None:
        try:
            zone = zoneinfo.ZoneInfo(time_zone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise CronError(f"time zone {time_zone!r} is not an IANA time zone name (e.g. Europe/Paris)") from None
    expression = " ".join(fields)
    try:
        croniter(expression, dt.datetime(2000, 1, 1, tzinfo=zone)).get_next(dt.datetime)
    except (CroniterError, ValueError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "failed to find next date" in reason:
            reason = "it never fires (a day that no month has?)"
        raise CronError(f"cron schedule {text!r} is not valid: {reason}") from None
    return Cron(expression, zone)
