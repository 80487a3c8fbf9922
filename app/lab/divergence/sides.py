"""A side of a divergence experiment (SideConfig: weights, kernel policy, batch context, engine
settings) and its mini-language: `key=value` pairs, e.g.
"weights=f32,policy=auto,threshold=8,alongside=120,60,30,join=4"."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine.config import WEIGHT_FORMATS, KernelPolicy, check_activations, check_native_setting
from engine.speculative import METHODS as SPECULATIVE_METHODS
from engine.speculative import draft_layers

MAX_ALONGSIDE = 32
MAX_ALONGSIDE_LEN = 8192


@dataclass(frozen=True)
class SideConfig:
    """One side of an experiment: how the target's steps are computed and what shares them."""

    weights: str = "auto"
    kernel_policy: str = "gemm"
    kernel_threshold: int = 1
    alongside: tuple[int, ...] = ()  # prompt lengths (tokens) of other requests
    join_at: int = 0  # others join in the step computing the target's output token #join_at
    alongside_max_tokens: int = 16  # tokens each other request generates (EOS ignored)
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    block_size: int = 16
    batch_invariant: bool = False  # the engine's tiled, batch-invariant path (if it has one)
    # The engine's row_kernels: a row's linear layers, norms, RoPE and logsumexp on the native
    # kernels ("auto"/"native") or on MLX's own ops ("mlx").
    row_kernels: str = "auto"
    # What the 4/8-bit linear layers multiply: "float32" activations or "int8" ones.
    activations: str = "float32"
    # Speculative decoding of the target (and the others): "off", "ngram" or "draft", k drafts
    # a step. A side speculates whatever shares its steps (no automatic turn-down).
    speculative: str = "off"
    num_speculative_tokens: int = 4
    # speculative "draft": the draft model, as the engine's --draft-model takes it (layers:N,
    # "embedded" or a folder); ignored by the other methods.
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, "
                             f"got {self.weights!r}")
        KernelPolicy(self.kernel_policy, self.kernel_threshold)  # raises on bad values
        check_native_setting("row_kernels", self.row_kernels)
        check_activations(self.activations)
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative!r}")
        if self.speculative == "draft":
            if not self.draft_model:
                raise ValueError("speculative=draft needs a draft model: draft=layers:N (or "
                                 "'embedded', or a folder) in the side, or --draft-model")
            draft_layers(self.draft_model)  # raises on a bad layers:N
        alongside = tuple(self.alongside)
        if len(alongside) > MAX_ALONGSIDE:
            raise ValueError(f"at most {MAX_ALONGSIDE} other requests, got {len(alongside)}")
        for n in alongside:
            if not isinstance(n, int) or not 1 <= n <= MAX_ALONGSIDE_LEN:
                raise ValueError(f"alongside lengths must be whole numbers from 1 to "
                                 f"{MAX_ALONGSIDE_LEN}, got {n!r}")
        object.__setattr__(self, "alongside", alongside)
        if not isinstance(self.join_at, int) or self.join_at < 0:
            raise ValueError(f"join_at must be a non-negative integer, got {self.join_at!r}")
        for name in ("alongside_max_tokens", "max_num_batched_tokens", "max_num_seqs",
                     "block_size", "num_speculative_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def policy(self) -> KernelPolicy:
        return KernelPolicy(self.kernel_policy, self.kernel_threshold)

    def label(self) -> str:
        path = "batch-invariant" if self.batch_invariant else self.policy.describe()
        if not self.alongside:
            context = "alone"
        else:
            lengths = ",".join(str(n) for n in self.alongside)
            context = f"alongside {lengths}" + (f" from token {self.join_at}"
                                                 if self.join_at else "")
        kernels = "" if self.row_kernels == "auto" else f" · row kernels {self.row_kernels}"
        if self.activations != "float32":
            kernels += f" · {self.activations} activations"
        spec = ("" if self.speculative == "off"
                else f" · {self.speculative} k={self.num_speculative_tokens}")
        if self.speculative == "draft":
            spec += f" ({self.draft_model})"
        return f"{self.weights} · {path}{kernels}{spec} · {context}"

    def engine_key(self) -> tuple:
        """Sides with equal keys share an engine (the kernel policy is set per run)."""
        return (self.weights, self.max_num_batched_tokens, self.max_num_seqs, self.block_size,
                self.batch_invariant, self.row_kernels, self.activations, self.speculative,
                self.num_speculative_tokens, self.engine_draft_model)

    @property
    def engine_draft_model(self) -> str | None:
        """The engine's draft_model: this side's, when it drafts with a model."""
        return self.draft_model if self.speculative == "draft" else None

    def to_dict(self) -> dict:
        return {**asdict(self), "alongside": list(self.alongside), "label": self.label()}

    @classmethod
    def from_dict(cls, data: dict) -> SideConfig:
        """A to_dict() back, records saved by older builds included (RENAMED_FIELDS)."""
        names = {f.name for f in fields(cls)}
        renamed = {RENAMED_FIELDS[k]: v for k, v in data.items() if k in RENAMED_FIELDS}
        return cls(**{k: v for k, v in {**renamed, **data}.items() if k in names})

    @classmethod
    def parse(cls, spec: str, base: SideConfig | None = None) -> SideConfig:
        """`key=value` pairs separated by commas, over `base`: e.g.
        "weights=f32,policy=auto,threshold=8,alongside=120,60,30,join=4" (bare numbers after
        alongside= extend the list; 120+60+30 works too). Keys: see SPEC_KEYS."""
        changes: dict[str, Any] = {}
        list_key = None
        for raw in (spec or "").split(","):
            item = raw.strip()
            if not item:
                continue
            if "=" not in item:
                if list_key is None:
                    raise ValueError(f"expected key=value, got {item!r} (keys: "
                                     f"{', '.join(SPEC_KEYS)})")
                changes[list_key] += _lengths(item)
                continue
            key, value = (s.strip() for s in item.split("=", 1))
            name = SPEC_KEYS.get(key.lower().replace("-", "_"))
            if name is None:
                raise ValueError(f"unknown side setting {key!r} (keys: {', '.join(SPEC_KEYS)})")
            list_key = None
            if name == "alongside":
                changes[name] = _lengths(value)
                list_key = name
            elif name in ("weights", "kernel_policy", "row_kernels", "activations", "speculative",
                          "draft_model"):
                changes[name] = value
            elif name == "batch_invariant":
                changes[name] = value.lower() in ("1", "true", "yes", "on")
            else:
                try:
                    changes[name] = int(value)
                except ValueError:
                    raise ValueError(f"{key} must be a whole number, got {value!r}") from None
        if "alongside" in changes:
            changes["alongside"] = tuple(changes["alongside"])
        return replace(base or cls(), **changes)


SPEC_KEYS = {
    "weights": "weights", "policy": "kernel_policy", "kernel_policy": "kernel_policy",
    "threshold": "kernel_threshold", "kernel_threshold": "kernel_threshold",
    "alongside": "alongside", "join": "join_at", "join_at": "join_at",
    "others_tokens": "alongside_max_tokens", "alongside_max_tokens": "alongside_max_tokens",
    "max_batched": "max_num_batched_tokens", "max_num_batched_tokens": "max_num_batched_tokens",
    "max_seqs": "max_num_seqs", "max_num_seqs": "max_num_seqs", "block_size": "block_size",
    "batch_invariant": "batch_invariant", "row_kernels": "row_kernels",
    "matmul": "row_kernels", "decode_matmul": "row_kernels",  # the setting's older names
    "activations": "activations",
    "speculative": "speculative", "spec": "speculative",
    "k": "num_speculative_tokens", "num_speculative_tokens": "num_speculative_tokens",
    "draft": "draft_model", "draft_model": "draft_model",
}


# A field's older name -> its name now, as records saved by older builds hold it.
RENAMED_FIELDS = {"decode_matmul": "row_kernels"}


def _lengths(text: str) -> list[int]:
    text = text.strip()
    if text.lower() in ("", "none", "alone"):
        return []
    out = []
    for part in text.replace("/", "+").split("+"):
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"alongside takes prompt lengths in tokens, got {part!r}") from None
    return out

