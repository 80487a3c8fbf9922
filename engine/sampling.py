"""Per-request sampling parameters (pure Python; the MLX sampler is engine/sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow (engine/structured.py): kind "json" (spec: a JSON
    Schema as JSON text), "regex", "choice" (a JSON list of the strings) or "grammar" (Lark,
    or GBNF)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS or not isinstance(self.spec, str):
            raise ValueError(f"structured output must be one of {', '.join(STRUCTURED_KINDS)} "
                             f"with its text, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # makes temperature sampling reproducible
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int = 0  # how many top alternatives to return with each token
    ignore_eos: bool = False
    # This request may take drafted tokens when the engine speculates (engine/speculative.py).
    speculative: bool = True
    # OpenAI's penalties over the tokens generated so far (engine/penalties.py): subtracted
    # from a token's logit, frequency_penalty once per time it was generated, presence_penalty
    # once if it was; and logit_bias, (token id, bias) pairs added to those tokens' logits.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's extensions: repetition_penalty over the prompt and the output (a seen token's
    # positive logit divided by it, a negative one multiplied; 1: none), and min_p (sampling
    # keeps the tokens at least min_p times as likely as the likeliest, as mlx-lm's
    # apply_min_p; 0: none).
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # The output follows this grammar (engine/structured.py; drafts are cut to what it
    # allows); such a request must end at end-of-sequence (ignore_eos is refused).
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, "
                             f"got {self.logprobs!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number from -2 to 2, got {value!r}")
        if (isinstance(self.repetition_penalty, bool)
                or not isinstance(self.repetition_penalty, int | float)
                or not 0.0 < self.repetition_penalty <= 2.0):
            raise ValueError("repetition_penalty must be a number in (0, 2], got "
                             f"{self.repetition_penalty!r}")
        if (isinstance(self.min_p, bool) or not isinstance(self.min_p, int | float)
                or not 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number from 0 to 1, got {self.min_p!r}")
        bias = tuple((t, b) for t, b in (self.logit_bias.items() if isinstance(
            self.logit_bias, dict) else self.logit_bias))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               or isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100
               for t, b in bias):
            raise ValueError("logit_bias must map token ids (non-negative integers) to biases "
                             "from -100 to 100")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in bias)))
        if self.structured is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a structured output: "
                             "the grammar ends at end-of-sequence")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a list of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
