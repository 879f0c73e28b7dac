"""The roofline cost model against figures worked out by hand from the published shapes and
the datasheets' peaks (every expected number below is arithmetic written out here, not a
second call into the model)."""
from __future__ import annotations

import json

import pytest

from pdtb.shapes.accelerators import accelerator, kv_link
from pdtb.sim.cost import LinkModel, StepShape
from pdtb.shapes.model_shape import ModelShape, shipped_configs
from pdtb.sim.roofline import RooflineCost, prefill_context

GIB = 2**30
# Llama-3-8B: vocab 128256, hidden 4096, 32 layers, 32 heads, 8 KV heads of 128, MLP 14336, untied
L8_EMBED = 128256 * 4096
L8_LAYER = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096  # q,o + k,v + MLP + norms
L8_PARAMS = 2 * L8_EMBED + 32 * L8_LAYER + 4096  # embeddings, lm_head, layers, final norm
L8_KV_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16


def test_llama3_8b_shape_by_hand():
    m = ModelShape.from_config("llama-3-8b")
    assert L8_PARAMS == 8_030_261_248  # the published 8.03B
    assert m.params == L8_PARAMS
    assert m.kv_bytes_per_token() == L8_KV_TOKEN == 131072
    assert m.weight_bytes() == 2 * L8_PARAMS
    assert m.flops_per_token(ctx=100) == 2 * L8_PARAMS + 4 * 32 * 32 * 128 * 100


@pytest.mark.parametrize("name, billions", [("llama-3-70b", 70.55), ("qwen2-7b", 7.62), ("mistral-7b", 7.25)])
def test_shipped_shapes_match_published_parameter_counts(name, billions):
    assert name in shipped_configs()
    assert ModelShape.from_config(name).params / 1e9 == pytest.approx(billions, abs=0.005)


def test_config_defaults_ties_and_errors(tmp_path):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, "tie_word_embeddings": True, "dtype": "float32"}
    m = ModelShape.from_config(cfg)
    assert (m.kv_heads, m.head_dim, m.dtype_bytes) == (4, 16, 4)  # KV heads = heads, head_dim = hidden / heads
    layer = 64 * 64 * 4 + 3 * 64 * 128 + 2 * 64
    assert m.params == 100 * 64 + 2 * layer + 64  # tied: no separate lm_head
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelShape.from_config(str(tmp_path)).params == m.params  # a checkpoint directory
    with pytest.raises(ValueError, match="missing vocab_size"):
        ModelShape.from_config({k: v for k, v in cfg.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="llama-3-8b"):
        ModelShape.from_config("no-such-model")


def test_batch1_decode_at_2k_is_memory_bound():
    c = RooflineCost.of("h100-sxm", "llama-3-8b")
    t = c.terms(StepShape(decode_rows=1, decode_ctx=2048))
    want_mem = (2 * L8_PARAMS + 2048 * L8_KV_TOKEN + L8_KV_TOKEN) / 3.35e12  # weights + KV read + written
    assert t.bound == "memory"
    assert t.memory_s == pytest.approx(want_mem, rel=1e-12)
    assert want_mem == pytest.approx(4.874e-3, abs=1e-6)
    assert c.step_s(StepShape(1, 2048)) == pytest.approx(want_mem + 1e-3, rel=1e-12)


def test_4096_token_prefill_is_compute_bound():
    c = RooflineCost.of("h100-sxm", "llama-3-8b")
    pairs = 4096 * 4097 // 2
    t = c.terms(StepShape(prefill_chunks=1, prefill_tokens=4096, prefill_attn=pairs))
    want = (2 * L8_PARAMS * 4096 + 4 * 32 * 32 * 128 * pairs) / 989e12
    assert t.bound == "compute" and t.compute_s == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(70.96e-3, abs=1e-5)
    assert t.memory_s == pytest.approx((2 * L8_PARAMS + 2 * 4096 * L8_KV_TOKEN) / 3.35e12, rel=1e-12)


def test_tensor_parallel_halves_weights_and_adds_all_reduces():
    one = RooflineCost.of("h100-sxm", "llama-3-8b")
    two = RooflineCost.of("h100-sxm", "llama-3-8b", tp=2)
    s = StepShape(decode_rows=1, decode_ctx=1)
    assert one.terms(s).memory_s * 3.35e12 == pytest.approx(2 * L8_PARAMS + 2 * L8_KV_TOKEN)
    assert two.terms(s).memory_s * 3.35e12 == pytest.approx(2 * L8_PARAMS / 2 + 2 * L8_KV_TOKEN / 2)
    # 2 all-reduces per layer of 1 token * 4096 * 2 bytes; ring over 2 GPUs sends (2 - 1) / 2 * 2 of it
    assert two.terms(s).comm_s == pytest.approx(2 * 32 * (5e-6 + 4096 * 2 / 450e9))
    assert one.terms(s).comm_s == 0
    assert two.page_bytes == one.page_bytes == 16 * L8_KV_TOKEN  # a logical page spans every rank


def test_pool_pages_by_hand():
    c8 = RooflineCost.of("h100-sxm", "llama-3-8b")
    assert c8.pool_pages() == int((0.9 * 80e9 - 2 * L8_PARAMS - 2 * GIB) // (16 * L8_KV_TOKEN)) == 25650
    # Llama-3-70B at tp=4: per GPU, a quarter of the weights and a quarter of each page
    p70 = 2 * 128256 * 8192 + 80 * (8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672 + 2 * 8192) + 8192
    page70 = 16 * 2 * 80 * 8 * 128 * 2
    c70 = RooflineCost.of("h100-sxm", "llama-3-70b", tp=4)
    assert c70.page_bytes == page70 == 5_242_880
    assert c70.pool_pages() == int((0.9 * 80e9 - 2 * p70 / 4 - 2 * GIB) // (page70 / 4)) == 26379


def test_a_128k_request_on_llama3_8b():
    c = RooflineCost.of("h100-sxm", "llama-3-8b")
    pages = 128 * 1024 // 16
    assert pages == 8192
    assert pages * c.page_bytes == 16 * GIB  # 131072 tokens * 131072 bytes
    assert c.transfer_s(16 * GIB) == pytest.approx(10e-6 + 16 * GIB / 50e9)  # 400 Gb/s NDR, 10 us
    assert c.tier_move_s(16 * GIB) == pytest.approx(10e-6 + 16 * GIB / 55e9)  # PCIe Gen5 effective
    tp2 = RooflineCost.of("h100-sxm", "llama-3-8b", tp=2)  # each GPU moves its half over its own link
    assert tp2.transfer_s(16 * GIB) == pytest.approx(10e-6 + 8 * GIB / 50e9)


def test_links_catalog_and_validation():
    assert kv_link(400).bytes_per_s == 50e9 and kv_link(100, 0).seconds(25e9) == 2.0
    h200, a100 = accelerator("h200"), accelerator("a100-80gb")
    assert (h200.hbm_bytes, h200.hbm_bytes_per_s, h200.flops) == (141e9, 4.8e12, 989e12)
    assert (a100.flops, a100.host_link.bytes_per_s) == (312e12, 25e9)
    with pytest.raises(ValueError, match="h100-sxm"):
        accelerator("tpu")
    with pytest.raises(ValueError, match="divide"):
        RooflineCost.of("h100-sxm", "llama-3-8b", tp=3)
    assert RooflineCost.of("h100-sxm", "llama-3-8b", tp=16).kv_share == 1 / 8  # a KV head per GPU, replicated
    assert RooflineCost.of("h100-sxm", "llama-3-8b", link=LinkModel(1e9)).transfer_s(1e9) == 1.0
    assert RooflineCost.of("h100-sxm", "llama-3-70b").pool_pages() == 0  # 141 GB of weights on one 80 GB GPU


def test_prefill_context_of_equal_chunks():
    # two chunks of 4 tokens at offsets 0 and 8 read 4 and 12 tokens
    attn = (4 * 0 + 4 * 5 // 2) + (4 * 8 + 4 * 5 // 2)
    assert prefill_context(StepShape(prefill_chunks=2, prefill_tokens=8, prefill_attn=attn)) == 16
    assert prefill_context(StepShape(decode_rows=3, decode_ctx=9)) == 0
