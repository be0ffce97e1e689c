"""Hand-built, deterministic tokenizers for the tiny offline checkpoints (no hub, no training).

Trained tokenizers (`tokenizers` trainers) order ties by hash-map order and differ between processes,
so every vocabulary here is written out by rule instead:

- CLIP and Qwen2 are byte-level BPE tokenizers. The vocabulary is the 256-symbol byte-level
  alphabet plus, for every word of a fixed list, the merges that assemble it. Merges are chosen by
  simulating BPE on the word with the merges so far and, whenever it gets stuck, appending a merge
  of the two leftmost symbols. New merges rank below all older ones, so they never change how an
  earlier word is split, and every listed word ends up as exactly one token.
- T5 is a Unigram tokenizer: `▁word` pieces with a high score, single characters with a low one.

Words outside the list still tokenize (CLIP/Qwen fall back to byte-level characters, T5 to
characters or `<unk>`); nothing crashes on unusual input.
"""

from __future__ import annotations

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

# QwenImagePipeline wraps every prompt in this chat template and drops the hidden states of the
# first `prompt_template_encode_start_idx` (= 34) tokens: the real tokenizer gives one token per
# word, comma, colon and newline of the system part, and so must ours.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
    "{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_PREFIX = QWEN_IMAGE_TEMPLATE.split("{}")[0]
QWEN_IMAGE_PREFIX_TOKENS = 34

COMMON_WORDS = (
    "a an and are at background big black blue book bright by cafe car cat city clear color colorful "
    "cup day detailing dog door flower for forest from green hello holding hours house image in is "
    "it large letters logo man neon night objects of on open orange painting park photo poster "
    "quantity red relationships river road says shape shop sign size sky small spatial store street "
    "sunny table text texture that the to tree white window with woman word world written yellow"
).split()

# Words that start a line in the Qwen chat template: they appear without a leading space.
QWEN_LINE_INITIAL_WORDS = ("system", "user", "assistant", "Describe")
QWEN_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 256
QWEN_MAX_LENGTH = 2048


def _byte_level_alphabet() -> list[str]:
    return sorted(ByteLevel.alphabet())


def _apply_merges(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Greedy BPE as `tokenizers` does it: merge the lowest-ranked adjacent pair, leftmost first."""
    symbols = list(symbols)
    while len(symbols) > 1:
        candidates = [
            (ranks[pair], index) for index, pair in enumerate(zip(symbols[:-1], symbols[1:])) if pair in ranks
        ]
        if not candidates:
            break
        _, index = min(candidates)
        symbols[index : index + 2] = [symbols[index] + symbols[index + 1]]
    return symbols


def _merges_for_words(words: list[list[str]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Extend `vocab` in place and return merges that turn each symbol list into one token."""
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for symbols in words:
        pieces = _apply_merges(symbols, ranks)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
            pieces = _apply_merges(pieces, ranks)
    return merges


def build_clip_tokenizer(words: tuple[str, ...] = tuple(COMMON_WORDS)) -> CLIPTokenizer:
    """CLIP BPE with `</w>` word ends; `<|startoftext|>`=0, `<|endoftext|>`=1 (also pad and unk)."""
    alphabet = _byte_level_alphabet()
    vocab: dict[str, int] = {CLIP_BOS: 0, CLIP_EOS: 1}
    for symbol in alphabet + [symbol + "</w>" for symbol in alphabet]:
        vocab.setdefault(symbol, len(vocab))
    # CLIP lowercases its input, so only lowercase spellings can ever be looked up.
    lowercase = sorted({word.lower() for word in words})
    symbol_lists = [list(word[:-1]) + [word[-1] + "</w>"] for word in lowercase]
    merges = _merges_for_words(symbol_lists, vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def build_qwen2_tokenizer(words: tuple[str, ...] = tuple(COMMON_WORDS)) -> Qwen2Tokenizer:
    """Qwen2 byte-level BPE: ` word` (as `Ġword`) tokens, line-initial template words, chat specials."""
    vocab: dict[str, int] = {symbol: index for index, symbol in enumerate(_byte_level_alphabet())}
    spaced = [["Ġ", *word] for word in sorted(set(words) | {"Describe"})]
    plain = [list(word) for word in QWEN_LINE_INITIAL_WORDS]
    merges = _merges_for_words(spaced + plain, vocab)
    for special in ("<|endoftext|>", *QWEN_SPECIAL_TOKENS):
        vocab.setdefault(special, len(vocab))
    # As in the real Qwen2.5-VL tokenizer: pad = `<|endoftext|>`, eos = `<|im_end|>`.
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=QWEN_MAX_LENGTH,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    return tokenizer


def build_t5_tokenizer(words: tuple[str, ...] = tuple(COMMON_WORDS)) -> T5Tokenizer:
    """T5 Unigram: `<pad>`=0, `</s>`=1, `<unk>`=2, `▁`, then `▁word` pieces and single characters."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    spellings = sorted({form for word in words for form in (word, word.capitalize())})
    pieces += [("▁" + word, -1.0) for word in spellings]
    printable = [chr(code) for code in range(33, 127)]
    pieces += [(char, -8.0) for char in printable]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)
