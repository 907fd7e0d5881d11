"""The tool-use world's tokenizer: byte-level BPE trained by the project, saved as a HF fast tokenizer."""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.chat import CHAT_TEMPLATE, EOS, IM_END, SPECIAL_TOKENS


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 512, single_token_markers: bool = True, merge_across_words: bool = True
) -> PreTrainedTokenizerFast:
    """Byte-level BPE with digits split one per token.

    Merges may cross word boundaries by default: the fixed system prompt and tool-call wrapper then
    shrink to a few tokens, which makes the tiny policy's sequences about 2× shorter.

    With `single_token_markers=False` the chat markers are ordinary text (split into several
    tokens), which is how the boundary search is tested for tokenizers that do not reserve them.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not merge_across_words),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS if single_token_markers else [EOS, IM_END, "<|im_start|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOS,
        additional_special_tokens=[t for t in specials if t not in (EOS, IM_END)],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
