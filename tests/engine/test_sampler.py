"""Sampling: greedy is argmax, seeded sampling is reproducible, top-p cuts the tail."""
from __future__ import annotations

import pytest
import torch

from conftest import make_engine, make_prompts
from pdtb.engine.sampler import sample
from pdtb.engine.sequence import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 9e-6])
def test_a_temperature_too_small_for_float32_samples_greedily(temperature):
    """logits / 1e-38 overflows float32 to inf (then NaN probabilities): such a request must
    be sampled greedily, not make the sampler raise inside a node's step and take the node
    down."""
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=temperature, seed=1)] * 2
    assert sample(logits, params, [0, 0]) == [1, 0]


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.8, seed=None)
    seen = {sample(logits, [p], [0])[0] for _ in range(300)}
    assert seen <= {0, 1} and seen == {0, 1}


def test_seeded_sampling_is_reproducible_and_node_independent(llama_dir):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    prompts = make_prompts((5, 40), seed=2)
    a = make_engine(llama_dir).generate(prompts, params)
    b = make_engine(llama_dir, page_size=7).generate(prompts[::-1], params)[::-1]
    assert [s.output_token_ids for s in a] == [s.output_token_ids for s in b]
    other = make_engine(llama_dir).generate(prompts, SamplingParams(**{**params.__dict__, "seed": 99}))
    assert [s.output_token_ids for s in a] != [s.output_token_ids for s in other]


def test_greedy_output_is_varied(llama_dir):
    """The embedded model must not collapse into one repeated token."""
    seqs = make_engine(llama_dir).generate(make_prompts((8, 30)), SamplingParams(max_tokens=32, ignore_eos=True))
    for s in seqs:
        assert len(set(s.output_token_ids)) >= 8


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-1), dict(top_p=0.0), dict(temperature=-1.0)])
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("top_p", [7e-46, 1e-300])
def test_a_top_p_below_float32_keeps_the_top_token(top_p):
    """top_p rounds to 0 in float32 below ~7e-46: the top token must still be kept, or
    multinomial raises inside the node's step and takes the node down (one HTTP request would
    do it)."""
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0]])
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=top_p, seed=3)], [0]) == [1]
