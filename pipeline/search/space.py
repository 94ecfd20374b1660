"""The search space: Hydra's sweep grammar of a ``-m`` command line as Optuna distributions.

``choice(a, b)`` and plain ``a,b`` lists are categorical, ``range(start, stop[, step])`` an integer (or, for
floats, a categorical of its values), ``interval(lo, hi)`` a float (an integer when both bounds are) and
``tag(log, interval(...))`` the same on a log scale. The other overrides are the trials' common base.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from pipeline.schema.errors import ConfigError

SEARCH_KEY = "search"
"""Overrides of this group or its keys configure the study; trials run without them."""
MAX_PROBES = 64
"""Most corner points validated before the first trial (every one for a small box)."""


@dataclass(frozen=True)
class Space:
    """The base overrides every trial shares and the searched keys' distributions (in command-line order)."""

    base: list[str]
    search: list[str]
    dims: dict[str, Any]

    def trial_overrides(self, params: dict[str, Any]) -> list[str]:
        """The command line of one trial: the base overrides plus each searched key at its sampled value."""
        return [*self.base, *(f"{k}={fmt(params[k])}" for k in self.dims)]

    def grid(self) -> dict[str, list[Any]]:
        """The points of every key for the grid sampler (choice and range keys only)."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        out: dict[str, list[Any]] = {}
        for k, d in self.dims.items():
            if isinstance(d, CategoricalDistribution):
                out[k] = list(d.choices)
            elif isinstance(d, IntDistribution) and not d.log:
                out[k] = list(range(d.low, d.high + 1, d.step))
            else:
                raise ConfigError(
                    f"{k}=interval(...): search.sampler=grid needs choice(...) or range(...) keys"
                )
        return out

    def corners(self) -> list[dict[str, Any]]:
        """Points probed before the first trial: every corner of the box (each categorical value), at most
        MAX_PROBES of them spread over the list."""
        from optuna.distributions import CategoricalDistribution

        axes = [
            list(d.choices) if isinstance(d, CategoricalDistribution) else sorted({d.low, d.high})
            for d in self.dims.values()
        ]
        points = [dict(zip(self.dims, p, strict=True)) for p in itertools.product(*axes)]
        if len(points) > MAX_PROBES:
            stride = len(points) / MAX_PROBES
            points = [points[int(i * stride)] for i in range(MAX_PROBES)] + [points[-1]]
        return points


def fmt(v: Any) -> str:
    """A sampled value as an override's value (floats exactly, strings as written)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(v)
    return str(v)


def parse(overrides: list[str]) -> Space:
    """Split a ``-m`` command line into the base overrides, the search's own and the searched keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    base: list[str] = []
    search: list[str] = []
    dims: dict[str, Any] = {}
    for o in parsed:
        key = o.get_key_element().lstrip("+~")
        if key == SEARCH_KEY or key.startswith(SEARCH_KEY + "."):
            search.append(str(o.input_line))
        elif o.is_sweep_override():
            dims[key] = distribution(key, o.value())
        else:
            base.append(str(o.input_line))
    if not dims:
        raise ConfigError(
            "search.enabled=true: no searched key; give one as key='interval(lo, hi)', "
            "key='choice(a, b)', key='range(lo, hi)' or key=a,b"
        )
    return Space(base, search, dims)


def distribution(key: str, sweep: Any) -> Any:
    """One sweep of Hydra's grammar as an Optuna distribution."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(sweep, ChoiceSweep):
        return CategoricalDistribution([_plain(v) for v in sweep.list])
    if isinstance(sweep, RangeSweep):
        start, stop, step = sweep.start, sweep.stop, sweep.step
        if start is None or stop is None:
            raise ConfigError(f"{key}=range(...): needs a start and a stop")
        if all(isinstance(x, int) for x in (start, stop, step)) and step > 0 and stop > start:
            last = start + (stop - 1 - start) // step * step
            return IntDistribution(int(start), int(last), step=int(step))
        values = [float(v) for v in _frange(float(start), float(stop), float(step))]
        if not values:
            raise ConfigError(f"{key}=range({start}, {stop}, {step}): an empty range")
        return CategoricalDistribution(values)
    if isinstance(sweep, IntervalSweep):
        log = "log" in sweep.tags
        lo, hi = sweep.start, sweep.end
        if lo is None or hi is None or not lo < hi:
            raise ConfigError(f"{key}=interval({lo}, {hi}): needs two bounds, low < high")
        if log and lo <= 0:
            raise ConfigError(f"{key}=tag(log, interval({lo}, {hi})): a log scale needs low > 0")
        if isinstance(lo, int) and isinstance(hi, int) and not isinstance(lo, bool):
            return IntDistribution(lo, hi, log=log)
        return FloatDistribution(float(lo), float(hi), log=log)
    raise ConfigError(f"{key}: not a sweep of choice(...), range(...) or interval(...)")


def _plain(v: Any) -> Any:
    """A parsed choice as a value Optuna can store (numbers, strings, booleans; else its text)."""
    return v if isinstance(v, bool | int | float | str) or v is None else str(v)


def _frange(start: float, stop: float, step: float) -> list[float]:
    out: list[float] = []
    if step == 0:
        return out
    x = start
    while (step > 0 and x < stop - 1e-12) or (step < 0 and x > stop + 1e-12):
        out.append(round(x, 12))
        x += step
    return out
