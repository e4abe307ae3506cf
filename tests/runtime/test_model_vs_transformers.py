"""Strand's paged forward pass against transformers' own forward, on tiny random checkpoints."""

import pytest
import torch

from strand.runtime.forward_batch import ForwardBatch
from strand.runtime.model_runner import ModelRunner
from strand.runtime.server_args import ServerArgs
from tests.conftest import build_tiny_checkpoint

ATOL = 2e-4

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {}),
    "mha-headdim": ("llama", {"num_key_value_heads": 4, "head_dim": 32}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[request.param]
    path = build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    runner = ModelRunner(ServerArgs(model_path=path, dtype="float32", max_total_tokens=1024,
                                    max_running_requests=8))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return runner, ref


def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()  # [len, V]


class Seqs:
    """Drives the runner like the scheduler does: a req_to_token row per sequence, slots per token."""

    def __init__(self, runner: ModelRunner):
        self.r = runner
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}

    def forward(self, parts: list[tuple[str, list[int], bool]]) -> list[torch.Tensor]:
        """parts: (name, new tokens, want logits of all of them?) extends first, decodes last."""
        r = self.r
        ids, pos, rows, prefix, ext, logit_rows = [], [], [], [], [], []
        off = 0
        for name, toks, all_logits in parts:
            if name not in self.rows:
                self.rows[name] = r.req_to_token_pool.alloc()
                self.lens[name] = 0
            start = self.lens[name]
            ids += toks
            pos += range(start, start + len(toks))
            rows.append(self.rows[name])
            prefix.append(start)
            ext.append(len(toks))
            logit_rows += range(off, off + len(toks)) if all_logits else [off + len(toks) - 1]
            off += len(toks)
        loc = r.allocator.alloc(off)
        p = 0
        for name, toks, _ in parts:
            start = self.lens[name]
            r.req_to_token_pool.req_to_token[self.rows[name], start:start + len(toks)] = loc[p:p + len(toks)]
            p += len(toks)
            self.lens[name] += len(toks)
        num_extends = sum(1 for _, t, _ in parts if len(t) > 1) if any(len(t) > 1 for _, t, _ in parts) else 0
        # the runner's contract: extends first; a 1-token "extend" is fine as a decode.
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), loc, rows, prefix, ext,
                             num_extends, torch.tensor(logit_rows), r.req_to_token_pool.req_to_token)
        out = r.forward(batch)
        res, k = [], 0
        for _, toks, all_logits in parts:
            n = len(toks) if all_logits else 1
            res.append(out[k:k + n])
            k += n
        return res


def tokens(seed: int, n: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_prefill_matches(pair):
    runner, ref = pair
    ids = tokens(1, 40)
    (got,) = Seqs(runner).forward([("a", ids, True)])
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=ATOL, rtol=1e-4)


def test_chunked_prefill_matches(pair):
    runner, ref = pair
    ids = tokens(2, 70)
    s = Seqs(runner)
    want = hf_logits(ref, ids)
    for lo, hi in [(0, 17), (17, 50), (50, 70)]:
        (got,) = s.forward([("a", ids[lo:hi], True)])
        torch.testing.assert_close(got, want[lo:hi], atol=ATOL, rtol=1e-4)


def test_decode_matches(pair):
    runner, ref = pair
    ids = tokens(3, 30)
    s = Seqs(runner)
    want = hf_logits(ref, ids)
    s.forward([("a", ids[:20], False)])
    for i in range(20, 30):
        (got,) = s.forward([("a", ids[i:i + 1], False)])
        torch.testing.assert_close(got[0], want[i], atol=ATOL, rtol=1e-4)


def test_mixed_batch_matches(pair):
    """One pass with an extend over a cached prefix, a fresh prefill and two decodes of other lengths."""
    runner, ref = pair
    a, b, c, d = tokens(4, 50), tokens(5, 23), tokens(6, 31), tokens(7, 9)
    s = Seqs(runner)
    s.forward([("a", a[:30], False)])  # cached prefix of a
    s.forward([("b", b[:-1], False), ("c", c[:-1], False)])
    got_a, got_d, got_b, got_c = s.forward([("a", a[30:], True), ("d", d, True),
                                            ("b", b[-1:], False), ("c", c[-1:], False)])
    torch.testing.assert_close(got_a, hf_logits(ref, a)[30:], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_d, hf_logits(ref, d), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_b[0], hf_logits(ref, b)[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_c[0], hf_logits(ref, c)[-1], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_reference(tiny_llama, dtype):
    """Weights in half precision (the KV pool and attention stay fp32 on the CPU)."""
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(ServerArgs(model_path=tiny_llama, dtype=dtype, max_total_tokens=512))
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    a, b = tokens(8, 30), tokens(9, 12)
    s = Seqs(runner)
    s.forward([("a", a[:-1], False), ("b", b[:-1], False)])
    got_a, got_b = s.forward([("a", a[-1:], False), ("b", b[-1:], False)])
    for got, ids in ((got_a, a), (got_b, b)):
        want = hf_logits(ref, ids)[-1]
        assert got.dtype == torch.float32
        assert (got[0] - want).abs().max() < 0.1 * want.abs().max()
