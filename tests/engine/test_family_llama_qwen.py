"""llama, mistral, qwen2, qwen3 and smollm3 against mlx-lm's own generation on tiny folders."""

from __future__ import annotations

import importlib

import pytest

from engine.testing import FAMILY_CONFIGS
from tests.family_models import check_batch_equals_alone, check_cli_equals_mlx_lm, make_folder

pytestmark = pytest.mark.slow

NAMES = ["llama", "llama-sliding", "mistral", "qwen2", "qwen3", "smollm3"]


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    module_name, config = FAMILY_CONFIGS[request.param]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    root = tmp_path_factory.mktemp(request.param)
    return (make_folder(root / "f32", module, config),
            make_folder(root / "q4", module, config, quantize=True))


def test_greedy_equals_mlx_lm_f32(family):
    check_cli_equals_mlx_lm(family[0], "f32")


def test_greedy_equals_mlx_lm_q4(family):
    check_cli_equals_mlx_lm(family[1], "q4")


def test_batched_equals_alone_q4(family):
    check_batch_equals_alone(family[1], "q4", long_prompt_tokens=90)
