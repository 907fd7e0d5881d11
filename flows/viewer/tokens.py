"""Token ids to text for the viewer, with the run's own tokenizer (never a guess).

Which tokenizer: the one the raw shard's manifest records as its input (the checkpoint that sampled it, as
`cleaner replay` finds it), else the run's run.json `rollout.policy`; when neither has a tokenizer.json the
page says so and shows ids. Pages need text per token (colour, loss mask, alignment), and a byte-level BPE
token may hold half of a UTF-8 character, so each token's bytes are read from the vocabulary and decoded
incrementally: a token shows the characters it completes, and the pieces of a sequence join to exactly its
decoded text.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.chat import BYTE_DECODER
from storage.layout import RunLayout, resolve_recorded
from storage.shards import read_manifest
from storage.texts import TOKENIZER_FILE, checkpoint_of


@dataclass(frozen=True)
class TokenizerSource:
    path: Path  # the tokenizer.json
    why: str  # where the path was recorded, shown on the page


class TokenText:
    """One tokenizer's ids as text: whole sequences (exactly the tokenizer's decode) and per-token pieces."""

    def __init__(self, source: TokenizerSource) -> None:
        from tokenizers import Tokenizer

        self.source = source
        self.tok = Tokenizer.from_file(str(source.path))
        spec = json.loads(source.path.read_text())
        self.byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self.added = {i: t.content.encode() for i, t in self.tok.get_added_tokens_decoder().items()}
        self._bytes: dict[int, bytes] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        b = self._bytes.get(i)
        if b is None:
            piece = self.tok.id_to_token(i)
            if i in self.added:
                b = self.added[i]
            elif piece is not None and self.byte_level and all(c in BYTE_DECODER for c in piece):
                b = bytes(BYTE_DECODER[c] for c in piece)
            else:  # not byte-level: the token decoded alone (its spacing may differ inside a sequence)
                b = self.decode([i]).encode("utf-8", "surrogatepass")
            self._bytes[i] = b
        return b

    def pieces(self, ids: list[int]) -> list[str]:
        """Per token, the characters it completes (a split UTF-8 character shows on its last token)."""
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        out = [dec.decode(self.token_bytes(i)) for i in ids]
        tail = dec.decode(b"", final=True)
        if tail and out:
            out[-1] += tail
        return out


_CACHE: dict[tuple[str, int], TokenText] = {}


def token_text(source: TokenizerSource) -> TokenText:
    key = (str(source.path), source.path.stat().st_mtime_ns)
    if key not in _CACHE:
        _CACHE[key] = TokenText(source)
    return _CACHE[key]


def find_source(root: Path, run_id: str, iteration: int) -> TokenizerSource | None:
    """The run's tokenizer for one iteration: the raw shard's recorded checkpoint, else run.json's policy."""
    layout = RunLayout(root, run_id)
    manifest = read_manifest(layout.raw_dir(iteration))
    if manifest is not None:
        checkpoint = checkpoint_of(Path(root).resolve(), manifest.inputs)
        if checkpoint is not None and (checkpoint / TOKENIZER_FILE).is_file():
            return TokenizerSource(
                checkpoint / TOKENIZER_FILE,
                f"the checkpoint that sampled it ({checkpoint}, recorded in the raw shard's manifest)",
            )
    try:
        policy = json.loads(layout.run_json.read_text())["rollout"]["policy"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = resolve_recorded(root, str(policy))
    if (path / TOKENIZER_FILE).is_file():
        return TokenizerSource(path / TOKENIZER_FILE, f"the run's rollout.policy ({path}, recorded in run.json)")
    return None
