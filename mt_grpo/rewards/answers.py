r"""Does an answer match the gold? The one rule behind every reward that compares with the gold aliases.

`answer_type` says how to compare. It comes per row, from the dataset's optional column `answer_type` (the
recipe's `answer_type` fills it; reward functions receive it as a keyword argument, TRL's way), and applies
to each gold alias on its own:

    text   SQuAD normalisation (`normalize_answer`): lower-case, no punctuation, no articles a/an/the.
           "Contains" means whole words: the alias "art" is not in "party".
    math   as numbers or math expressions, with Hugging Face's math_verify (parse, then verify): 308.0 == 308,
           1,000 == 1000, 1/2 == 0.5 == \frac{1}{2}; and 35 != 3.5, -4 != 4, which text normalisation
           confuses (it deletes the "." and the "-"). An alias math_verify cannot parse is compared as text.
    auto   the default (None too): math for an alias that is a number (308, -4, 1,000, 0.5), a fraction
           (3/4) or LaTeX without words ($...$, \(...\), \[...\], or with a command: \frac{1}{2}); text
           for anything else: "Tifex River", "73 million", "Catch-22", and "007", whose zeros are a code's.

Equal (`matches_answer`, the exact-match reward): against a math alias, the prediction must itself be a
number, a fraction or LaTeX that math_verify finds equal ("1289 BC" is not exactly 1289). Contains
(`contains_answer`, the other rewards): some number, fraction or LaTeX span of the text equals the math
alias: "The total is 1,000 apples." holds 1000; "35 apples" does not hold 3.5.

Left out on purpose: the model's answer and the tool's reply are untrusted text, and sympy takes minutes
on 10^{10^{10}} or 100000! while nothing can stop it (see `_safe`). So a prediction with a power or a
factorial is not compared as math: a gold alias may hold one (2^{10}), and the model must write its value
(1024).
"""

import functools
import logging
import re
import string

ANSWER_TYPES = ("auto", "text", "math")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop the articles a/an/the, collapse spaces."""
    s = s.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def normalized_aliases(answer) -> list[str]:
    """An answer's aliases (a string, or a list of them) normalised (normalize_answer), the empty ones left out: an
    empty alias would be found in every text."""
    aliases = [answer] if isinstance(answer, str) else list(answer or [])
    return [a for a in (normalize_answer(str(x)) for x in aliases) if a]


def contains_words(text: str, alias: str) -> bool:
    """Whole-word containment of normalised strings (which are single-space separated)."""
    return f" {alias} " in f" {text} "


def check_answer_type(value) -> str:
    """One row's answer_type: "auto", "text" or "math"; None means "auto"."""
    if value is None:
        return "auto"
    if value not in ANSWER_TYPES:
        raise ValueError(f"answer_type {value!r} is not one of {', '.join(map(repr, ANSWER_TYPES))}: set the "
                         "dataset column `answer_type` (or the recipe's answer_type) to one of them, or leave it "
                         "out for auto (numbers compare as numbers, words as SQuAD-normalised text).")
    return value


def answer_types(answer_type, n: int) -> list[str]:
    """The `answer_type` a reward function receives (the dataset column, a list with one value per sample;
    None without the column; one string for every sample) as n checked values."""
    if answer_type is None or isinstance(answer_type, str):
        return [check_answer_type(answer_type)] * n
    values = [check_answer_type(v) for v in answer_type]
    if len(values) != n:
        raise ValueError(f"answer_type has {len(values)} values for {n} samples: give one per sample.")
    return values


# ------------------------------------------------------------------------------------------------
# What reads as math: one number pattern for the auto rule and for the numbers found in a text
# ------------------------------------------------------------------------------------------------
# 308, 1,000, 12,345.6, 0.5, .5; no leading zero ("007" is a code, not 7)
_NUMBER = r"(?:[1-9]\d{0,2}(?:,\d{3})+|[1-9]\d*|0)(?:\.\d+)?|\.\d+"
_SIGNED = rf"[-\u2212]?(?:{_NUMBER})"  # \u2212 is the typographic minus
_PLAIN = re.compile(rf"{_SIGNED}(?:\s*/\s*{_SIGNED})?")  # a number or a fraction, the whole string
_LATEX = re.compile(r"\$.+\$|\\\(.+\\\)|\\\[.+\\\]", re.DOTALL)  # delimited, the whole string
_COMMAND = re.compile(r"\\([a-zA-Z]+)")
# A number or a fraction inside text, not part of a word, a version (3.5.1) or a date (1/2/2020)
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.,/]){_PLAIN.pattern}(?![\w/]|[.,]\d)")
# A delimited LaTeX span inside text, math when `_is_math` says so ("$5 and $10" is money, not math)
_LATEX_IN_TEXT = re.compile(r"\$[^$]+\$|\\\(.+?\\\)|\\\[.+?\\\]", re.DOTALL)
_WORD = re.compile(r"[a-zA-Z]{2,}")


def _is_math(s: str) -> bool:
    """The auto rule: the whole string (a final full stop allowed) is a number, a fraction, or LaTeX (delimited,
    or with a command) without a word outside its commands: "AC\\DC" and "$\\text{12 apples}$" are text."""
    s = s.strip()
    s = s[:-1].rstrip() if s.endswith(".") else s
    if _PLAIN.fullmatch(s):
        return True
    return bool(_LATEX.fullmatch(s) or _COMMAND.search(s)) and not _WORD.search(_COMMAND.sub(" ", s))


# Untrusted text (the model's answer, a tool's reply) reaches sympy only when it is short and asks for no
# huge number: sympy evaluates 10^{10^{10}} or 100000! for minutes, and a timeout could not help (below).
MAX_MATH_CHARS = 100
_SAFE_COMMANDS = {"frac", "dfrac", "tfrac", "sqrt", "pi", "cdot", "times", "div", "left", "right", "boxed"}
_HUGE = re.compile(r"[\^!]|\*\*")  # powers and factorials


def _safe(s: str) -> bool:
    """Untrusted `s` may go to sympy: at most MAX_MATH_CHARS, no power or factorial, only _SAFE_COMMANDS."""
    return len(s) <= MAX_MATH_CHARS and not _HUGE.search(s) and set(_COMMAND.findall(s)) <= _SAFE_COMMANDS


# ------------------------------------------------------------------------------------------------
# math_verify: parse once, compare many times
# ------------------------------------------------------------------------------------------------
# Timeouts off: math_verify times out with signal.alarm, which raises ValueError outside the main thread
# (the async rollout thread scores rewards) and cannot interrupt one long C-level integer power anyway.
# `_safe` bounds what untrusted text may ask instead; gold aliases come from the dataset and are trusted.
_TIMEOUT_OFF = "Timeout is disabled"


@functools.cache
def _math_verify():
    """The math_verify module, imported on first use: its sympy and ANTLR cost about 0.5 s, and text
    answers never need it. Its warning that timeouts are off is dropped: we turn them off on purpose."""
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith(_TIMEOUT_OFF))
    return math_verify


@functools.lru_cache(maxsize=65536)
def _parse(s: str) -> tuple:
    """math_verify's expressions for `s` (LaTeX first, then a plain expression), () when none parses."""
    mv = _math_verify()
    s = s.replace("\u2212", "-")
    return tuple(mv.parse(s, extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                          fallback_mode="no_fallback", parsing_timeout=None))


@functools.lru_cache(maxsize=65536)
def _equal(gold: str, candidate: str) -> bool:
    """math_verify says the candidate equals the gold alias; cached, as a group's episodes share results."""
    expected, got = _parse(gold), _parse(candidate)
    return bool(expected and got) and _math_verify().verify(list(expected), list(got), timeout_seconds=None)


@functools.lru_cache(maxsize=65536)
def _gold_is_math(alias: str, answer_type: str) -> bool:
    """Whether this alias compares as math under `answer_type` (checked): auto asks `_is_math`, and either
    needs math_verify to parse it (else it is text)."""
    return answer_type != "text" and (answer_type == "math" or _is_math(alias)) and bool(_parse(alias))


def _split(answer, answer_type: str) -> tuple[list[str], list[str]]:
    """(text aliases normalised, math aliases as written); empty aliases left out."""
    aliases = [str(a).strip() for a in ([answer] if isinstance(answer, str) else list(answer or []))]
    aliases = [a for a in aliases if a]
    math = [a for a in aliases if _gold_is_math(a, answer_type)]
    return normalized_aliases([a for a in aliases if a not in math]), math


# ------------------------------------------------------------------------------------------------
# The two questions the rewards ask
# ------------------------------------------------------------------------------------------------
def matches_answer(prediction: str | None, answer, answer_type: str | None = "auto") -> bool:
    """The prediction equals a gold alias of `answer` (list[str], or one str): as normalised text, or for a
    math alias as a number, fraction or LaTeX that math_verify finds equal. None matches nothing."""
    if prediction is None:
        return False
    text_aliases, math_aliases = _split(answer, check_answer_type(answer_type))
    if normalize_answer(prediction) in text_aliases:
        return True
    candidate = prediction.strip().removesuffix(".").strip()
    return _is_math(candidate) and _safe(candidate) and any(_equal(a, candidate) for a in math_aliases)


def _math_spans(text: str) -> list[str]:
    """The text if it is one expression, its numbers and fractions, and its LaTeX spans: the candidates that
    math_verify compares with a math alias.

    A regex finds them and math_verify parses each: its own extraction gives one expression for a whole
    text (the match it ranks first), so it cannot list every number of a document, and it reads "1,2" as
    1.2 and "2:30" as 2."""
    whole = text.strip().removesuffix(".").strip()  # an answer that is one expression: \frac{1}{2} holds 1/2
    spans = [whole] if _is_math(whole) else []
    spans += [m.group() for m in _NUMBER_IN_TEXT.finditer(text)]
    return spans + [m.group() for m in _LATEX_IN_TEXT.finditer(text) if _is_math(m.group())]


def contains_answer(text: str | None, answer, answer_type: str | None = "auto") -> bool:
    """`text` holds a gold alias of `answer`: a text alias as whole words of the normalised text, a math
    alias as one of the text's numbers, fractions or LaTeX spans that math_verify finds equal."""
    text_aliases, math_aliases = _split(answer, check_answer_type(answer_type))
    words = normalize_answer(text or "")
    if any(contains_words(words, a) for a in text_aliases):
        return True
    spans = [s for s in _math_spans(text or "") if _safe(s)] if math_aliases else []
    return any(_equal(a, s) for a in math_aliases for s in spans)
