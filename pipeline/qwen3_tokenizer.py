"""The Qwen3 tokenizer, built from a package-registry source (no model hub).

The byte-level BPE vocabulary and merges of Qwen2/2.5/3 come from the source distribution of
`llama-cpp-python` (`vendor/llama.cpp/models/ggml-vocab-qwen2.gguf`, with llama.cpp's own
tokenization test vectors `.inp/.out` beside it), read by transformers' GGUF converter. Qwen3 then
puts its added tokens at the GGUF's placeholder ids (`[PAD151646]`…) in the order below, and its
public chat template (the Qwen3-0.6B template that the same sdist ships under
`vendor/llama.cpp/models/templates/`) renders tools in the system turn, tool results as a user turn
wrapped in `<tool_response>` and `<think>` blocks with `enable_thinking` on or off.

The built files are committed under `policies/qwen3-tokenizer/` (so tests need no network);
`python -m pipeline.qwen3_tokenizer` rebuilds them from the sdist (needs the `gguf` package).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "policies" / "qwen3-tokenizer"
SDIST = "llama-cpp-python==0.3.36"
GGUF_MEMBER = "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
TEMPLATE_MEMBER = "vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja"
LICENSE_MEMBER = "vendor/llama.cpp/LICENSE"
VECTORS = ("ggml-vocab-qwen2.gguf.inp", "ggml-vocab-qwen2.gguf.out")

REGULAR_TOKENS = 151_643  # ids 0..151642: byte-level BPE pieces
MODEL_VOCAB = 151_936  # rows of Qwen3's embedding matrix (the tokenizer itself has 151,669 entries)
# (id, content, special) exactly as Qwen3's tokenizer_config.json lists them; "special" only says
# whether decode(skip_special_tokens=True) drops it — every one of them is a single added token.
ADDED_TOKENS: list[tuple[int, str, bool]] = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]
TOOL_CALL_ID = 151657
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def qwen3_tokenizer_json(gguf_tokenizer_json: str) -> str:
    """The GGUF-converted tokenizer.json re-laid as Qwen3's: BPE vocab 0..151642, added tokens at their ids."""
    spec = json.loads(gguf_tokenizer_json)
    vocab = spec["model"]["vocab"]
    regular = {piece: i for piece, i in vocab.items() if i < REGULAR_TOKENS}
    if len(regular) != REGULAR_TOKENS or sorted(regular.values()) != list(range(REGULAR_TOKENS)):
        raise ValueError(f"the GGUF vocabulary does not hold ids 0..{REGULAR_TOKENS - 1} (got {len(regular)} pieces)")
    placeholders = {i: piece for piece, i in vocab.items() if i >= REGULAR_TOKENS}
    for i, _content, _ in ADDED_TOKENS[3:]:  # the placeholders Qwen3 gives a meaning
        if placeholders.get(i) != f"[PAD{i}]":
            raise ValueError(f"id {i} is {placeholders.get(i)!r} in the GGUF, expected the placeholder [PAD{i}]")
    spec["model"]["vocab"] = regular
    spec["added_tokens"] = [
        {
            "id": i,
            "content": c,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": s,
        }
        for i, c, s in ADDED_TOKENS
    ]
    # Offsets/decoding settings as in Qwen's own tokenizer.json (ids are unaffected by them).
    spec["post_processor"] = dict(BYTE_LEVEL)
    spec["decoder"] = dict(BYTE_LEVEL)
    return json.dumps(spec, ensure_ascii=False, indent=None)


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(i): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for i, c, s in ADDED_TOKENS
        },
    }


def build(sdist_dir: Path, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and the test vectors to `out`."""
    from transformers import AutoTokenizer

    models = sdist_dir / "vendor/llama.cpp/models"
    gguf_tok = AutoTokenizer.from_pretrained(str(models), gguf_file=Path(GGUF_MEMBER).name)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(qwen3_tokenizer_json(gguf_tok.backend_tokenizer.to_str()))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
    shutil.copyfile(sdist_dir / TEMPLATE_MEMBER, out / "chat_template.jinja")
    shutil.copyfile(sdist_dir / LICENSE_MEMBER, out / "LICENSE-llama.cpp")
    (out / "vectors").mkdir(exist_ok=True)
    for name in VECTORS:
        shutil.copyfile(models / name, out / "vectors" / name)


# Qwen3's generation prompt (the end of the committed template), and the one Qwen3-4B-Thinking-2507 ships
# instead: the 2507 thinking models' template opens every assistant turn with `<think>\n` and has no
# enable_thinking switch; the rest of the template (tools, tool turns, reasoning in history) is Qwen3's.
QWEN3_GENERATION_BLOCK = (
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
)
THINKING_2507_GENERATION_BLOCK = (
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}"
)
TEMPLATE_FAMILIES = ("qwen3", "thinking-2507")


def chat_template(family: str = "qwen3") -> str:
    """The chat template text of a Qwen3 family, from the committed Qwen3 template."""
    text = (TOKENIZER_DIR / "chat_template.jinja").read_text(encoding="utf-8")
    if family == "qwen3":
        return text
    if family != "thinking-2507":
        raise ValueError(f"unknown chat template family {family!r}; one of {', '.join(TEMPLATE_FAMILIES)}")
    if not text.endswith(QWEN3_GENERATION_BLOCK):
        raise ValueError(f"{TOKENIZER_DIR / 'chat_template.jinja'} does not end with Qwen3's generation prompt block")
    return text[: -len(QWEN3_GENERATION_BLOCK)] + THINKING_2507_GENERATION_BLOCK


def fetch_sdist(dest: Path, requirement: str = SDIST) -> Path:
    """Download the sdist with pip (the ordinary registry client) and unpack only what is needed."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            requirement,
            "-d",
            str(dest),
            "-q",
        ],
        check=True,
    )
    (archive,) = dest.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        root = tar.getnames()[0].split("/")[0]
        wanted = [GGUF_MEMBER, TEMPLATE_MEMBER, LICENSE_MEMBER] + [f"vendor/llama.cpp/models/{v}" for v in VECTORS]
        tar.extractall(dest, members=[tar.getmember(f"{root}/{m}") for m in wanted], filter="data")
    return dest / root


def read_vectors(directory: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test vectors: inputs separated by `__ggml_vocab_test__` lines, one id line each."""
    # every input is followed by the separator, so the text after the last one is empty
    inputs = (directory / VECTORS[0]).read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    outputs = (directory / VECTORS[1]).read_text(encoding="utf-8").split("\n")[:-1]
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} expected outputs in {directory}")
    return [(text, [int(x) for x in ids.split()]) for text, ids in zip(inputs, outputs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild policies/qwen3-tokenizer/ from the llama-cpp-python sdist")
    ap.add_argument("--sdist-dir", type=Path, help="an unpacked llama_cpp_python-*/ (default: pip download it)")
    ap.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist_dir or fetch_sdist(Path(tmp))
        build(sdist, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
