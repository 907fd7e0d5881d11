"""Where a response's answer is: the last `\\boxed{...}` near its end (docs/saar.md). Read by the
rewards (rollout_gen/rewards.py) and by purification's void-turn check (purifier/saar.py)."""

from __future__ import annotations

BOXED = "\\boxed{"
WINDOW = 100  # characters at the end of the response in which the answer box must lie


def last_boxed(text: str, window: int = WINDOW) -> str | None:
    """The content of the last `\\boxed{...}` that lies whole in the final `window` characters (braces
    nest; a box that never closes there is skipped), stripped; None when there is none."""
    tail = text[-window:]
    close: dict[int, int] = {}  # index of each '{' -> index of its matching '}', in one pass
    opened: list[int] = []
    for i, ch in enumerate(tail):
        if ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            close[opened.pop()] = i
    start = len(tail)
    while (start := tail.rfind(BOXED, 0, start)) >= 0:
        brace = start + len(BOXED) - 1
        if brace in close:
            return tail[brace + 1 : close[brace]].strip()
    return None
