"""A five-field cron schedule (minute hour day-of-month month day-of-week, UTC), as ``warmUp.schedule.cron``.

No cron library is installed (croniter is not a dependency), and the operator needs only one
question answered: "did a scheduled minute pass between the last run's start and now?". Fields take
``*``, numbers, ranges ``a-b``, lists ``a,b`` and steps ``*/n``, ``a-b/n``; day-of-week 0-7 with 0 and
7 both Sunday. Names (``MON``, ``JAN``) and the ``@daily`` shorthands are refused with a message.
Day-of-month and day-of-week combine as in Vixie cron: when both are restricted, either may match.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

# (low, high) of each field.
_BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
_NAMES = ("minute", "hour", "day of month", "month", "day of week")
# How far ``due`` looks back: a schedule that has not fired for 400 days is due anyway (a yearly
# schedule fires within 366 days); bounds the minute walk to about 576,000 steps in the worst case.
MAX_LOOKBACK = dt.timedelta(days=400)


class CronError(ValueError):
    """A schedule that cannot be parsed; the message names the field."""


@dataclass(frozen=True)
class Cron:
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_restricted: bool
    weekdays_restricted: bool

    def matches(self, when: dt.datetime) -> bool:
        if when.minute not in self.minutes or when.hour not in self.hours or when.month not in self.months:
            return False
        day_ok = when.day in self.days
        weekday_ok = (when.isoweekday() % 7) in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return day_ok or weekday_ok
        return day_ok and weekday_ok

    def due(self, since: dt.datetime, now: dt.datetime) -> bool:
        """Whether a scheduled minute lies in ``(since, now]`` (both aware, any zone)."""
        if now - since > MAX_LOOKBACK:
            return True
        minute = since.astimezone(dt.timezone.utc).replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        end = now.astimezone(dt.timezone.utc)
        while minute <= end:
            if self.matches(minute):
                return True
            # Skip whole hours and days that cannot match: keeps a daily schedule's walk short.
            if minute.hour not in self.hours or minute.month not in self.months:
                minute = (minute + dt.timedelta(hours=1)).replace(minute=0)
            else:
                minute += dt.timedelta(minutes=1)
        return False


def _field(text: str, index: int) -> tuple[frozenset[int], bool]:
    low, high = _BOUNDS[index]
    name = _NAMES[index]
    values: set[int] = set()
    for part in text.split(","):
        body, slash, step_text = part.partition("/")
        try:
            step = int(step_text) if slash else 1
            if body == "*":
                start, stop = low, high
            elif "-" in body:
                a, b = body.split("-", 1)
                start, stop = int(a), int(b)
            else:
                start = stop = int(body)
                if slash:
                    stop = high
        except ValueError:
            raise CronError(f"cron {name} field {text!r}: expected *, numbers, ranges a-b, lists and steps /n") from None
        if step < 1 or not low <= start <= stop <= high:
            raise CronError(f"cron {name} field {text!r}: values must be from {low} to {high}, ranges low-high, steps >= 1")
        values.update(range(start, stop + 1, step))
    return frozenset(values), text != "*"


def parse_cron(text: str) -> Cron:
    fields = text.split()
    if len(fields) != 5:
        raise CronError(f"cron schedule {text!r} must have five fields: minute hour day-of-month month day-of-week")
    parsed = [_field(f, i) for i, f in enumerate(fields)]
    weekdays = frozenset(d % 7 for d in parsed[4][0])
    return Cron(parsed[0][0], parsed[1][0], parsed[2][0], parsed[3][0], weekdays,
                days_restricted=parsed[2][1], weekdays_restricted=parsed[4][1])
