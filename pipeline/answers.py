"""Where a response's answer is: the last `\\boxed{...}` near its end (docs/saar.md), found as the CLEANER paper's
scorer finds it (verl's math_dapo: `last_boxed_only_string` over the last 100 characters). Read by the rewards
(rollout_gen/rewards.py) and by purification's void-turn check (purifier/saar.py)."""

from __future__ import annotations

BOXED = "\\boxed{"
WINDOW = 100  # characters at the end of the response in which the answer box must lie


def last_box(text: str, window: int = WINDOW) -> str | None:
    """The content, as written, of the last `\\boxed{` in the final `window` characters when it closes there (braces
    nest); None when there is none, or when the last one never closes: an earlier box does not stand in for it."""
    tail = text[-window:]
    start = tail.rfind(BOXED)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(BOXED) - 1, len(tail)):
        if tail[i] == "{":
            depth += 1
        elif tail[i] == "}":
            depth -= 1
            if depth == 0:
                return tail[start + len(BOXED) : i]
    return None


def last_boxed(text: str, window: int = WINDOW) -> str | None:
    """`last_box`, stripped: the answer as stored and as compared by equivalence."""
    box = last_box(text, window)
    return None if box is None else box.strip()
