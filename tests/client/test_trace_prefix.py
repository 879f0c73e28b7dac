"""Shared prompt blocks: trace hash_ids and tenants' system prompts become prompts that share
exactly the prefixes the workload says, and requests without blocks keep their old prompts."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pdtb.client import workloads as wl
from pdtb.client.serve import build_parser, build_workload
from pdtb.client.prefix import ideal_hit_rate, ideal_hit_tokens, with_system_prompts
from pdtb.figures.records import RequestSpec
from pdtb.client.load import RunConfig, request_body
from pdtb.client.traces import parse_jsonl, read_trace, trace_specs

DATA = Path(__file__).resolve().parents[2] / "pdtb" / "client" / "data"
VOCAB = 5000


def make_cfg(seed: int = 3, **kw) -> RunConfig:
    return RunConfig("http://unused", None, VOCAB, seed=seed, **kw)


def make_spec(prompt_len: int, blocks=(), block_len: int = 0, tenant: str = "t") -> RequestSpec:
    return RequestSpec(0.0, tenant, "trace", prompt_len, 4, blocks=tuple(blocks), block_len=block_len)


def prompt(cfg: RunConfig, index: int, spec: RequestSpec) -> list[int]:
    return json.loads(request_body(cfg, index, spec))["prompt"]


def trace_lines(*rows) -> list[str]:
    return [json.dumps({"timestamp": 100 * i, "input_length": n, "output_length": 8, "hash_ids": ids})
            for i, (n, ids) in enumerate(rows)]


def test_shared_leading_blocks_are_identical_and_the_rest_differs():
    specs, info = trace_specs(parse_jsonl(trace_lines((1536, [1, 2, 3]), (1536, [1, 2, 4]))), length_scale=1 / 16)
    assert info["block_tokens"] == 32 and info["rows_with_hash_ids"] == 2
    cfg = make_cfg()
    a, b = prompt(cfg, 0, specs[0]), prompt(cfg, 1, specs[1])
    assert len(a) == len(b) == 96
    assert a[:64] == b[:64] and a[64:] != b[64:]
    assert prompt(cfg, 0, specs[0]) == a  # deterministic
    assert prompt(cfg, 7, specs[0]) == a  # a block is the same whatever request carries it
    assert prompt(make_cfg(seed=4), 0, specs[0])[:32] != a[:32]  # another run seed, other blocks


def test_a_block_depends_only_on_its_id_not_its_position():
    cfg = make_cfg()
    a = prompt(cfg, 0, make_spec(20, [5, 6], 10))
    b = prompt(cfg, 1, make_spec(20, [6, 5], 10))
    assert a[:10] == b[10:] and a[10:] == b[:10]


def test_requests_without_blocks_keep_the_old_prompt_ids():
    cfg = make_cfg(seed=11, min_token_id=16)
    for i, n in enumerate([1, 7, 300]):
        old = np.random.default_rng([11, i]).integers(16, VOCAB, n).tolist()  # the formula before blocks
        assert prompt(cfg, i, make_spec(n)) == old


def test_length_scale_sets_the_block_and_the_last_block_is_cut():
    rows = parse_jsonl(trace_lines((1200, [1, 2, 3])))
    specs, info = trace_specs(rows, length_scale=0.1)
    assert info["block_tokens"] == 51 and specs[0].prompt_len == 120  # round(51.2), round(120.0)
    assert specs[0].blocks == (1, 2, 3) and specs[0].block_len == 51
    ids = prompt(make_cfg(), 0, specs[0])
    whole = prompt(make_cfg(), 0, make_spec(153, [1, 2, 3], 51))
    assert ids == whole[:120]
    specs, info = trace_specs(rows, length_scale=0.1, block_tokens=16)
    assert info["block_tokens"] == 16 and specs[0].block_len == 16
    tiny, info = trace_specs(rows, length_scale=1e-4)
    assert info["block_tokens"] == 1 and tiny[0].prompt_len == 1


def test_prompt_longer_than_its_blocks_ends_with_its_own_tokens():
    cfg = make_cfg()
    a, b = prompt(cfg, 0, make_spec(30, [9], 10)), prompt(cfg, 1, make_spec(30, [9], 10))
    assert len(a) == 30 and a[:10] == b[:10] and a[10:] != b[10:]


def test_max_context_clamp_keeps_the_leading_blocks():
    rows = parse_jsonl(trace_lines((2048, [1, 2, 3, 4])))
    specs, info = trace_specs(rows, length_scale=1 / 16, max_context=49)  # 128 + 1 tokens -> 48 + 1
    assert info["clamped_by_max_context"] == 1 and specs[0].prompt_len == 48
    full = prompt(make_cfg(), 0, make_spec(128, [1, 2, 3, 4], 32))
    assert prompt(make_cfg(), 0, specs[0]) == full[:48]
    assert ideal_hit_tokens(specs + [replace(specs[0], prompt_len=128)]) == (48, 176)


def test_rows_without_hash_ids_replay_as_before():
    lines = [json.dumps({"timestamp": 0, "input_length": 64, "output_length": 8})]
    specs, info = trace_specs(parse_jsonl(lines))
    assert specs[0].blocks == () and info["block_tokens"] is None and info["rows_with_hash_ids"] == 0
    assert ideal_hit_rate(specs) is None


@pytest.mark.parametrize("ids", ['"abc"', "[1, -2]", "[1.5]", "[true]"])
def test_bad_hash_ids_name_their_line(ids):
    with pytest.raises(ValueError, match="trace line 1"):
        parse_jsonl(['{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": %s}' % ids])


@pytest.mark.parametrize("name, section", [("conversation", "## Conversation"), ("synthetic", "## Synthetic")])
def test_the_shipped_excerpts_load_and_match_their_readme(name, section):
    rows, fmt = read_trace(DATA / f"mooncake_{name}_excerpt.jsonl")
    assert fmt == "jsonl" and 200 <= len(rows) <= 400 and all(r.hash_ids for r in rows)
    readme = (DATA / "README.md").read_text()
    stated = float(re.search(r"\*\*(0\.\d+)\*\*", readme[readme.index(section):]).group(1))
    specs, info = trace_specs(rows)
    assert info["block_tokens"] == 512
    assert ideal_hit_rate(specs) == pytest.approx(stated, abs=5e-4)
    assert "Apache License" in (DATA / "LICENSE-APACHE").read_text()


def test_each_tenant_has_its_own_system_prompt():
    specs = [make_spec(n, tenant=t) for t, n in [("a", 40), ("b", 40), ("a", 50), ("a", 10)]]
    specs = with_system_prompts(specs, 32)
    cfg = make_cfg()
    p = [prompt(cfg, i, s) for i, s in enumerate(specs)]
    assert [len(x) for x in p] == [40, 40, 50, 10]
    assert p[0][:32] == p[2][:32] and p[0][:32] != p[1][:32]
    assert p[3] == p[0][:10]  # shorter than the system prompt: its first tokens
    assert p[0][32:] != p[2][32:40]
    # hand count: request 2 hits a's 32 tokens, request 3 its 10 of them; b and the first a none
    assert ideal_hit_tokens(specs) == (42, 140)


def test_shared_system_prompts_map_tenants_in_turn():
    specs = with_system_prompts([make_spec(8, tenant=t) for t in "abcd"], 8, ["a", "b", "c", "d"], shared=2)
    assert specs[0].blocks == specs[2].blocks != specs[1].blocks == specs[3].blocks


def test_system_prompt_flags_on_synthetic_workloads():
    argv = ["--workload", "multi-tenant", "--duration", "5", "--prompt", "100", "--system-prompt-tokens", "64"]
    specs, info = build_workload(build_parser().parse_args(argv))
    assert info["system_prompts"] == {"tokens": 64, "shared": None}
    assert {s.block_len for s in specs} == {64} and len({s.blocks for s in specs}) == 4
    first_seen = len({s.tenant for s in specs})
    assert ideal_hit_tokens(specs) == (64 * (len(specs) - first_seen), 100 * len(specs))
    plain = build_workload(build_parser().parse_args(argv[:-2]))[0]
    assert [replace(s, blocks=(), block_len=0) for s in specs] == plain
    wm = build_workload(build_parser().parse_args(["--workload", "whale-minnow", "--system-prompt-tokens", "16",
                                                   "--shared-system-prompts", "1"]))[0]
    assert len({s.blocks for s in wm}) == 1
    with pytest.raises(ValueError, match="needs --system-prompt-tokens"):
        build_workload(build_parser().parse_args(["--workload", "whale-minnow", "--shared-system-prompts", "2"]))


def test_system_prompts_refuse_a_trace_that_has_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(trace_lines((600, [1, 2]))))
    a = build_parser().parse_args(["--workload", f"trace:{path}", "--system-prompt-tokens", "8"])
    with pytest.raises(ValueError, match="already share blocks"):
        build_workload(a)


def test_whale_minnow_without_the_flag_is_unchanged():
    specs = build_workload(build_parser().parse_args(["--workload", "whale-minnow", "--seed", "5"]))[0]
    assert specs == wl.whale_minnow(wl.WhaleMinnowConfig(), 5) and not any(s.blocks for s in specs)


def test_a_sweeps_trace_periods_share_no_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(trace_lines((1024, [0, 1]), (1024, [0, 2]))))
    a = build_parser().parse_args(["--workload", f"trace:{path}"])
    first = build_workload(a)[0]
    assert [s.blocks for s in first] == [(0, 1), (0, 2)]  # seed 0: the trace's own ids
    later = build_workload(replace_seed(a, 1))[0]
    assert later[0].blocks[0] == later[1].blocks[0] and not set(later[0].blocks) & {0, 1, 2}
    assert ideal_hit_rate(later) == ideal_hit_rate(first) == pytest.approx(512 / 2048)


def replace_seed(a, seed: int):
    return type(a)(**{**vars(a), "seed": seed})
