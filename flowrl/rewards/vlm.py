"""`vlm`: a vision-language judge behind an OpenAI-compatible chat-completions endpoint.

Each question is a template file the user edits (`template`; the packaged defaults are in
judge_templates/), filled with the row's `{prompt}` and `{ground_truth}` (its metadata; a row
without one cannot be scored) and the scale's `{min_score}`/`{max_score}`; write literal braces
as `{{` and `}}`. Three modes:

- `score`: the first number in the answer, on the scale [min_score, max_score]; with `normalize`
  (default) mapped to [0, 1] as (s - min) / (max - min), else reported raw. A number off the scale
  or no number is an unparsable answer.
- `yes_prob`: P("yes") for the first answer token, from the returned top log-probs
  (`logprobs: true, top_logprobs: K`): exp(logprob) summed over the tokens that read "yes" once
  case, spaces and tokenizer word marks are dropped ("Yes", " yes", "YES"). An answer without
  log-probs is unparsable.
- `pairwise` (Pref-GRPO): a group-wise reward (flowrl.rewards.groups). For each group, pairs of
  its images are shown as A and B, in an order drawn from the seed, and the judge names the better
  one (the one letter, A or B, its answer holds). A row's score is its win rate, wins / comparisons;
  a row in no comparison (a group of one, or left out by the bound) gets 0.5. All G(G-1)/2 pairs are
  asked unless `max_comparisons_per_group` is smaller: then that many pairs, drawn without
  replacement from (seed, group). The component `num_comparisons` (each row: its group's count)
  reports it.

Requests of a batch go out at once, at most `max_concurrency` in flight over every caller of
this reward; retries, backoff and named failures are flowrl.rewards.chat_client's. A row that
still fails is a RewardError naming the row, its prompt and the failure (unreachable, timed out,
rate limited, HTTP status, unparsable); as an optional component (or through `score_or_nan`) the
row alone is NaN (in pairwise mode, its whole group). A failure is never scored 0.
"""

from __future__ import annotations

import math
import re
import string
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from flowrl.rewards.base import RewardError, validate_batch
from flowrl.rewards.chat_client import ChatClient, JudgeError, read_api_key, user_message
from flowrl.rewards.groups import GroupReward, group_key, group_rows

MODES = ("score", "yes_prob", "pairwise")
PLACEHOLDERS = ("prompt", "ground_truth", "min_score", "max_score")
TEMPLATE_DIR = Path(__file__).parent / "judge_templates"
_DEFAULT_MAX_TOKENS = {"score": 16, "yes_prob": 1, "pairwise": 8}
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_LETTER = re.compile(r"\b([AB])\b")


def load_template(path: str | None, mode: str) -> tuple[str, set[str]]:
    """(template text, the placeholders it uses); ValueError naming the file and a wrong placeholder."""
    file = TEMPLATE_DIR / f"{mode}.txt" if path is None else Path(str(path)).expanduser()
    if not file.is_file():
        raise ValueError(f"vlm option template={str(path)!r} is not an existing file; give a text file's path")
    text = file.read_text()
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as error:
        raise ValueError(f"vlm template {file}: {error}; write literal braces as {{{{ and }}}}") from None
    unknown = sorted(name for name in used if name not in PLACEHOLDERS)
    if unknown:
        raise ValueError(
            f"vlm template {file} uses the placeholder(s) {unknown}; allowed: "
            + ", ".join("{" + name + "}" for name in PLACEHOLDERS)
            + " (write literal braces as {{ and }})"
        )
    return text, used


def _plain_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def parse_score(content: str, min_score: float, max_score: float) -> float:
    """The first number of the answer, checked against the scale."""
    found = _NUMBER.search(content or "")
    if found is None:
        raise JudgeError("unparsable", f"answer {content[:200]!r} holds no number")
    value = float(found.group())
    if not min_score <= value <= max_score:
        raise JudgeError("unparsable", f"answer {content[:200]!r}: {value} is off the scale [{min_score}, {max_score}]")
    return value


def parse_yes_probability(choice: dict) -> float:
    """P(yes) of the first answer token from its top log-probs (module docstring)."""
    try:
        candidates = choice["logprobs"]["content"][0]["top_logprobs"]
        pairs = [(str(item["token"]), float(item["logprob"])) for item in candidates]
    except (KeyError, IndexError, TypeError, ValueError):
        raise JudgeError(
            "unparsable",
            "the answer carries no top log-probs for its first token; the server must support "
            "logprobs with top_logprobs (vLLM and SGLang do), or use mode=score",
        ) from None
    if not pairs:
        raise JudgeError("unparsable", "the answer's first token has an empty top_logprobs list; raise top_logprobs")
    return float(min(1.0, sum(math.exp(lp) for token, lp in pairs if token.strip(" \t\n▁Ġ").lower() == "yes")))


def parse_choice(content: str) -> int:
    """0 for A, 1 for B: the one letter the answer names."""
    letters = set(_LETTER.findall(content or ""))
    if len(letters) != 1:
        raise JudgeError("unparsable", f"answer {content[:200]!r} does not name exactly one of A and B")
    return 0 if letters == {"A"} else 1


def comparison_pairs(size: int, limit: int | None, seed: int, key: str) -> list[tuple[int, int]]:
    """The (first shown, second shown) pairs of positions asked for a group of `size` (module docstring)."""
    pairs = [(i, j) for i in range(size) for j in range(i + 1, size)]
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    if limit is not None and len(pairs) > limit:
        pairs = [pairs[k] for k in sorted(rng.choice(len(pairs), size=limit, replace=False))]
    flips = rng.random(len(pairs)) < 0.5
    return [(j, i) if flip else (i, j) for (i, j), flip in zip(pairs, flips)]


class VlmReward(GroupReward):
    """A VLM judge over chat completions (module docstring)."""

    name = "vlm"

    def __init__(
        self,
        url: str,
        model: str,
        mode: str = "score",
        template: str | None = None,
        min_score: float = 0.0,
        max_score: float = 10.0,
        normalize: bool = True,
        top_logprobs: int = 20,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        max_concurrency: int = 16,
        max_comparisons_per_group: int | None = None,
        seed: int = 0,
        timeout_s: float = 60.0,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        api_key_env: str | None = None,
        extra_body: dict | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"vlm option url={url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000/v1 "
                "(requests go to URL/chat/completions)"
            )
        if not isinstance(model, str) or not model:
            raise ValueError(f"vlm option model={model!r} must be the served model's name (GET URL/models lists them)")
        if mode not in MODES:
            raise ValueError(f"vlm option mode={mode!r} must be one of {', '.join(MODES)}")
        if not max_score > min_score:
            raise ValueError(f"vlm options min_score={min_score}, max_score={max_score}: max_score must be larger")
        for option, value, low in (
            ("top_logprobs", top_logprobs, 1),
            ("max_concurrency", max_concurrency, 1),
            ("max_attempts", max_attempts, 1),
            ("seed", seed, 0),
            ("max_tokens", 1 if max_tokens is None else max_tokens, 1),
            ("max_comparisons_per_group", 1 if max_comparisons_per_group is None else max_comparisons_per_group, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"vlm option {option}={value!r} must be an integer >= {low}")
        if timeout_s <= 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(
                f"vlm options timeout_s={timeout_s}, backoff_s={backoff_s}, max_backoff_s={max_backoff_s} "
                "must be positive"
            )
        if extra_body is not None and not isinstance(extra_body, dict):
            raise ValueError(f"vlm option extra_body={extra_body!r} must be a mapping merged into each request")
        self.mode, self.model = mode, model
        self.template, self.placeholders = load_template(template, mode)
        self.min_score, self.max_score, self.normalize = float(min_score), float(max_score), bool(normalize)
        self.max_comparisons_per_group, self.seed = max_comparisons_per_group, seed
        self.scores_groups = mode == "pairwise"
        self.request_settings = {"max_tokens": max_tokens or _DEFAULT_MAX_TOKENS[mode], "temperature": temperature}
        if mode == "yes_prob":
            self.request_settings.update(logprobs=True, top_logprobs=top_logprobs)
        self.request_settings.update(extra_body or {})
        self.client = ChatClient(
            url, read_api_key(api_key_env), timeout_s, max_attempts, backoff_s, max_backoff_s, max_concurrency, sleep
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="flowrl-vlm")
        self._lock = threading.Lock()
        self.num_requests = 0  # requests answered so far (all modes), for tests and logs

    # -- what is asked -------------------------------------------------------------------------
    def cannot_score(self, metadata: dict) -> str | None:
        if "ground_truth" in self.placeholders and metadata.get("ground_truth") is None:
            return "its vlm template quotes {ground_truth} and the row has none; add a ground_truth column"
        return None

    def question(self, prompt: str, metadata: dict) -> str:
        reason = self.cannot_score(metadata)
        if reason is not None:
            raise ValueError(reason)
        values = {"prompt": prompt, "ground_truth": metadata.get("ground_truth")}
        values.update(min_score=_plain_number(self.min_score), max_score=_plain_number(self.max_score))
        return self.template.format(**values)

    def request_body(self, question: str, images: list[np.ndarray]) -> dict:
        """The chat-completions request of one question about `images` (as the OpenAI client sends it)."""
        return {"model": self.model, "messages": [user_message(question, images)], **self.request_settings}

    def ask(self, question: str, images: list[np.ndarray]) -> dict:
        if self.is_cancelled:
            raise RuntimeError("scoring was cancelled: the run is stopping")
        choice = self.client.complete(self.request_body(question, images))
        with self._lock:
            self.num_requests += 1
        return choice

    # -- pointwise modes -----------------------------------------------------------------------
    def _score_row(self, image: np.ndarray, prompt: str, metadata: dict) -> float:
        choice = self.ask(self.question(prompt, metadata), [image])
        if self.mode == "yes_prob":
            return parse_yes_probability(choice)
        value = parse_score(_content(choice), self.min_score, self.max_score)
        return (value - self.min_score) / (self.max_score - self.min_score) if self.normalize else value

    def _failure(self, row: int, prompt: str, error: BaseException, what: str = "") -> RewardError:
        wrapped = RewardError(self.name, row, f"{what}{error} (prompt {prompt[:200]!r})")
        wrapped.__cause__ = error
        return wrapped

    def _score_pointwise(self, images, prompts, metadata):
        futures = [self._pool.submit(self._score_row, *row) for row in zip(images, prompts, metadata)]
        scores, failures = np.full(len(prompts), np.nan), []
        for row, future in enumerate(futures):
            try:
                scores[row] = future.result()
            except Exception as error:
                failures.append(self._failure(row, prompts[row], error))
        return scores, {self.name: scores}, failures

    # -- pairwise mode -------------------------------------------------------------------------
    def _compare(self, images, prompt: str, metadata: dict, first: int, second: int) -> int:
        """The batch row of the image the judge prefers."""
        choice = self.ask(self.question(prompt, metadata), [images[first], images[second]])
        return (first, second)[parse_choice(_content(choice))]

    def _score_pairwise(self, images, prompts, metadata, groups):
        asked = []  # (group, first row, second row, future)
        for index, rows in enumerate(groups):
            key = group_key(prompts[rows[0]], metadata[rows[0]])
            for i, j in comparison_pairs(len(rows), self.max_comparisons_per_group, self.seed, key):
                future = self._pool.submit(self._compare, images, prompts[rows[0]], metadata[rows[0]], rows[i], rows[j])
                asked.append((index, rows[i], rows[j], future))
        wins, counts = np.zeros(len(prompts)), np.zeros(len(prompts))
        num_comparisons, failures, failed_groups = np.zeros(len(prompts)), [], set()
        for index, first, second, future in asked:
            num_comparisons[groups[index]] += 1
            try:
                winner = future.result()
            except Exception as error:
                low, high = sorted((first, second))
                failures.append(self._failure(low, prompts[low], error, f"comparing rows {low} and {high}: "))
                failed_groups.add(index)
                continue
            wins[winner] += 1
            counts[[first, second]] += 1
        scores = np.where(counts > 0, wins / np.maximum(counts, 1), 0.5)
        for index in failed_groups:
            scores[groups[index]] = np.nan
        return scores, {self.name: scores, "num_comparisons": num_comparisons}, failures

    # -- the Reward interface ------------------------------------------------------------------
    def _score_all(self, images, prompts, metadata, groups=None):
        if self.mode == "pairwise":
            groups = group_rows(prompts, metadata) if groups is None else groups
            return self._score_pairwise(images, prompts, metadata, groups)
        return self._score_pointwise(images, prompts, metadata)

    def score_groups(self, images, prompts, metadata, groups):
        scores, components, failures = self._score_all(images, prompts, metadata, groups)
        if failures:
            raise min(failures, key=lambda failure: failure.row_index)
        return scores, components

    def score_or_nan(self, images, prompts, metadata):
        images = validate_batch(images, prompts, metadata)
        scores, _, failures = self._score_all(images, list(prompts), list(metadata))
        return scores, failures

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _content(choice: dict) -> str:
    try:
        content = choice["message"]["content"]
    except (KeyError, TypeError):
        raise JudgeError("unparsable", f"the answer has no message content: {str(choice)[:200]!r}") from None
    if not isinstance(content, str):
        raise JudgeError("unparsable", f"the answer's content is not text: {str(content)[:200]!r}")
    return content
