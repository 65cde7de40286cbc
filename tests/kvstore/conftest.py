"""Shared fixtures of the KV store tests: a tiny model with sharp logits and its reference outputs."""

from __future__ import annotations

import pytest

from tests.kvstore.test_tiers import PROMPTS, _llm, _run


@pytest.fixture(scope="session")
def sharp_model(tmp_path_factory):
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("sharp")), logit_scale=4.0)


@pytest.fixture(scope="session")
def reference(sharp_model):
    llm = _llm(sharp_model, enable_prefix_caching=False, num_gpu_blocks=256)
    return [_run(llm, [p])[0] for p in PROMPTS]
