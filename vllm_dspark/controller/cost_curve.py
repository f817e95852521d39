"""Step-cost curves in a JSON file: pinned costs for the controller, and the
curves the simulator replays traces on.

A curve file holds the linear step-time models the controller uses, each
``{"t0": s, "t_req": s, "t_tok": s}`` for T(R, B) = t0 + t_req R + t_tok B::

    {"name": "my-h200",
     "spec":  {...},   # a target step that verifies drafts (required)
     "plain": {...},   # a target step without drafts (default: same as spec)
     "draft": {...},   # drafting R blocks of K tokens, B = R K (default: free)
     "walk":  {...},   # one position of the Markov walk over R blocks (B = 0);
                       # given, "draft" is the rest of drafting and the
                       # controller may walk fewer than K positions (default:
                       # none, "draft" holds the whole walk and it walks K)
     "nospec": {...}}  # simulator only: a step of an engine without speculation
                       # configured (default: same as plain)

Given as ``additional_config["dspark"]["cost_curve"]``, it replaces online
learning (the controller still reports its prediction error). Users who
measured their GPU once use it like SGLang's cost table; the tests use it to
make the controller's choices independent of the machine's speed.
"""

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_dspark.controller.cost_model import CostParams

PARAM_KEYS = ("t0", "t_req", "t_tok")
FREE = CostParams(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class CostCurve:
    name: str
    spec: CostParams
    plain: CostParams
    draft: CostParams = FREE
    nospec: CostParams | None = None
    walk: CostParams | None = None

    def to_json(self) -> dict:
        keys = ("spec", "plain", "draft") + tuple(k for k in ("walk", "nospec") if getattr(self, k) is not None)
        return {"name": self.name, **{k: asdict(getattr(self, k)) for k in keys}}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


def _params(data: dict, key: str, where: str) -> CostParams:
    raw = data[key]
    if not isinstance(raw, dict) or set(raw) != set(PARAM_KEYS):
        raise ValueError(f'{where}: "{key}" must be an object with exactly the keys '
                         f"{list(PARAM_KEYS)} (seconds), got {raw!r}")
    values = {}
    for k in PARAM_KEYS:
        v = raw[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
            raise ValueError(f'{where}: "{key}.{k}" must be a finite number >= 0 (seconds), got {v!r}')
        values[k] = float(v)
    return CostParams(**values)


def curve_from_json(data: object, where: str = "cost curve") -> CostCurve:
    if not isinstance(data, dict) or "spec" not in data:
        raise ValueError(f'{where}: expected a JSON object with at least a "spec" entry '
                         '({"t0": s, "t_req": s, "t_tok": s})')
    unknown = set(data) - {"name", "spec", "plain", "draft", "walk", "nospec"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid keys are name, spec, plain, draft, "
                         "walk, nospec")
    spec = _params(data, "spec", where)
    curve = CostCurve(
        name=str(data.get("name", where)),
        spec=spec,
        plain=_params(data, "plain", where) if "plain" in data else spec,
        draft=_params(data, "draft", where) if "draft" in data else FREE,
        nospec=_params(data, "nospec", where) if "nospec" in data else None,
        walk=_params(data, "walk", where) if "walk" in data else None,
    )
    if curve.spec.predict(1, 1) <= 1e-6:
        raise ValueError(f'{where}: "spec" predicts a zero step time; give t0 or t_tok > 0')
    return curve


def load_cost_curve(path: str | Path) -> CostCurve:
    """Read and check a curve file; ValueError says what is wrong and where.
    A file is read once per version (path, size and modification time)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{str(path)!r} is not a file; give the path of a JSON cost curve")
    st = p.stat()
    return _load(str(path), str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _load(path: str, resolved: str, size: int, mtime_ns: int) -> CostCurve:
    p = Path(resolved)
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON ({e})") from None
    return curve_from_json(data, where=str(path))
