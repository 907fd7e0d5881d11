"""A stage's identity: what its committed output was made from, and the one rule for keeping that output.

Each stage declares beside itself what its output depends on, as a record of its config and inputs
(`rollout_identity` in rollout_gen/stage.py, `purify_identity` in purifier/stage.py, `update_identity` in
trainer/stage.py, `eval_identity` in rollout_gen/eval_stage.py). Here are the rest, once for every stage: the
settings that only change how fast a stage runs (left out of every identity and of a run's frozen config,
flows/run_config.py), the hash of a record, the place where identities of earlier recipes are upgraded, the check of
a committed output against an identity, the refusal when it was made from other inputs, and the digest of an input
file.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from storage.errors import CleanerError
from storage.shards import ShardError

# Settings that change how fast a stage runs, and what it writes only by float rounding (torch's CPU reductions
# depend on the thread count: ~1e-6 in a log-prob, a sampled token rarely). Every identity hashes them at their
# default, so an output committed at any speed has the identity it has at the default one; a run's frozen config
# leaves them out. A run resumes, and a stage keeps what it committed, at another speed.
SPEED_ONLY = ("rollout.engine_tuning.threads",)

Config = TypeVar("Config")  # pipeline.config.CleanerConfig, which this floor does not import


def _parents_and_name(path: str) -> tuple[list[str], str]:
    *parents, name = path.split(".")
    return parents, name


def at_speed_defaults(cfg: Config) -> Config:
    """A copy of a config tree with every speed-only setting at its default."""
    same = cfg.model_copy(deep=True)
    for path in SPEED_ONLY:
        parents, name = _parents_and_name(path)
        section = functools.reduce(getattr, parents, same)
        setattr(section, name, type(section).model_fields[name].default)
    return same


def without_speed_only(data: dict) -> dict:
    """A config tree dumped as JSON (a run's frozen config) without its speed-only settings."""
    out = copy.deepcopy(data)
    for path in SPEED_ONLY:
        parents, name = _parents_and_name(path)
        functools.reduce(lambda node, key: node.get(key) or {}, parents, out).pop(name, None)
    return out


def identity_hash(record: object) -> str:
    """The hash of an identity record: blake2b (8 bytes) of its JSON with sorted keys, or of a text as it is."""
    text = record if isinstance(record, str) else json.dumps(record, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def file_digest(path: Path | str, size: int = 16) -> str:
    """The content identity of an input file (a task file), wherever it is and whatever its name: blake2b of its
    bytes, read a block at a time."""
    h = hashlib.blake2b(digest_size=size)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class StageIdentity:
    """The identity of one stage output: its record's hash now, and what earlier recipes hashed the same inputs to
    (outputs those committed keep matching)."""

    value: str
    legacy: tuple[str, ...] = ()


def stage_identity(
    cfg: Config, record: Callable[[Config], object], *earlier: Callable[[Config], object]
) -> StageIdentity:
    """The identity of a stage's declared `record` of `cfg`: its hash with the speed-only settings at their
    defaults. The one place earlier records are upgraded: an output committed before a setting was speed-only hashed
    the config as it was given, and `earlier` recipes of the same inputs hashed it their way; both match too."""
    value = identity_hash(record(at_speed_defaults(cfg)))
    legacy = dict.fromkeys(identity_hash(r(cfg)) for r in (record, *earlier))
    return StageIdentity(value, tuple(h for h in legacy if h != value))


def committed_with_same_inputs(recorded: str | None, identity: StageIdentity) -> bool:
    """Whether an output that records `recorded` was made from the inputs `identity` names (an output that records
    nothing is an earlier cleaner's, kept as it was)."""
    return recorded is None or recorded == identity.value or recorded in identity.legacy


def check_committed(
    out: Path,
    recorded: str | None,
    identity: StageIdentity,
    *,
    made_with: str,
    remedy: str,
    error: type[CleanerError] = ShardError,
) -> None:
    """A committed output made from other inputs is never overwritten, nor kept as if it were this call's: refused
    in one line that names what differs (`made_with`: 'with other rollout settings') and how to go on."""
    if not committed_with_same_inputs(recorded, identity):
        raise error(
            f"{out}: committed {made_with} or by an earlier cleaner (config hash {recorded}, now "
            f"{identity.value}); {remedy}"
        )
