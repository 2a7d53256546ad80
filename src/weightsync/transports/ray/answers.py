"""One round of Ray calls, one per worker, sorted by outcome: answered, dead, silent (no
answer in time, or unreachable), or answered with an error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _cause(exc: BaseException) -> BaseException:
    """The user-level exception inside a RayTaskError (or the error itself)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@dataclass
class Answers:
    """What the actors made of one round of Ray calls."""

    values: dict[int, Any] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)  # the actor is gone
    silent: dict[int, str] = field(default_factory=dict)  # no answer in time / unreachable
    errors: dict[int, BaseException] = field(default_factory=dict)  # answered with an error


def collect_answers(ray: Any, refs: Mapping[int, Any], timeout: float | None) -> Answers:
    """Wait (at most ``timeout``) for one Ray call per worker and sort the outcomes."""
    out = Answers()
    if not refs:
        return out
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    done = set(ready)
    for w, ref in refs.items():
        if ref not in done:
            out.silent[w] = f"no answer within {timeout or 0:.1f}s (stopped, or busy)"
            continue
        try:
            out.values[w] = ray.get(ref, timeout=0)
        except ray.exceptions.ActorUnavailableError as exc:
            out.silent[w] = f"unreachable: {exc}"
        except ray.exceptions.RayActorError as exc:
            out.dead[w] = f"actor died: {type(exc).__name__}"
        except ray.exceptions.RayTaskError as exc:
            out.errors[w] = _cause(exc)
        except ray.exceptions.GetTimeoutError:
            out.silent[w] = "no answer in time"
    return out
