"""The batch sampler, one parameter at a time, on synthetic logits."""

import math

import pytest
import torch

from strand.runtime.errors import InvalidRequestError
from strand.runtime.sampler import SampleRow, sample
from strand.runtime.sampling_params import SamplingParams

V = 50


def row(prompt=(), out=(), seed=None, stop_ids=(), lp=False, top=0, **params):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRow(SamplingParams.from_dict(params), list(prompt), list(out), gen, list(stop_ids), top, lp)


def logits_(seed=0, B=1):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


G = torch.Generator().manual_seed(0)


def test_greedy_and_top_k_1_equal_argmax():
    lg = logits_(1, B=4)
    want = lg.argmax(-1).tolist()
    assert sample(lg.clone(), [row(temperature=0)] * 4, G).next_ids == want
    assert sample(lg.clone(), [row(temperature=1.0, top_k=1)] * 4, G).next_ids == want


def test_seed_reproduces_and_differs_across_seeds():
    lg = logits_(2)
    def draw(seed):
        r = row(temperature=1.0, seed=seed)
        return [sample(lg.clone(), [r], G).next_ids[0] for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_seeded_row_does_not_depend_on_batch_neighbours():
    lg = logits_(3, B=3)
    alone = sample(lg[1:2].clone(), [row(temperature=1.0, seed=5)], G).next_ids[0]
    together = sample(lg.clone(), [row(temperature=1.0), row(temperature=1.0, seed=5), row(temperature=0)],
                      G).next_ids[1]
    assert alone == together


def test_top_k_restricts_to_k_best():
    lg = logits_(4)
    allowed = set(lg[0].topk(3).indices.tolist())
    seen = {sample(lg.clone(), [row(temperature=5.0, top_k=3)], G).next_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_smallest_nucleus():
    lg = torch.full((1, V), -20.0)
    lg[0, :4] = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    seen = {sample(lg.clone(), [row(temperature=1.0, top_p=0.7)], G).next_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7


def test_min_p_masks_below_threshold():
    lg = torch.full((1, V), -20.0)
    lg[0, :3] = torch.tensor([0.6, 0.3, 0.1]).log()
    seen = {sample(lg.clone(), [row(temperature=1.0, min_p=0.4)], G).next_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.1 < 0.4 * 0.6


def test_temperature_sharpens():
    lg = logits_(5)
    best = int(lg.argmax())
    hits = sum(sample(lg.clone(), [row(temperature=0.05)], G).next_ids[0] == best for _ in range(100))
    assert hits >= 98


def test_frequency_and_presence_penalties():
    lg = torch.zeros(1, V)
    lg[0, 3] = 1.0
    lg[0, 4] = 0.9
    # token 3 seen twice in the output: 1.0 - 2 * 0.1 = 0.8 < 0.9
    assert sample(lg.clone(), [row(out=[3, 3], temperature=0, frequency_penalty=0.1)], G).next_ids == [4]
    assert sample(lg.clone(), [row(out=[3, 3], temperature=0, presence_penalty=0.05)], G).next_ids == [3]
    assert sample(lg.clone(), [row(out=[3, 3], temperature=0, presence_penalty=0.2)], G).next_ids == [4]


def test_repetition_penalty_counts_prompt_tokens():
    lg = torch.zeros(1, V)
    lg[0, 3] = 1.0
    lg[0, 4] = 0.8
    assert sample(lg.clone(), [row(prompt=[3], temperature=0, repetition_penalty=1.5)], G).next_ids == [4]
    assert sample(lg.clone(), [row(prompt=[9], temperature=0, repetition_penalty=1.5)], G).next_ids == [3]


def test_min_new_tokens_masks_stop_ids():
    lg = torch.zeros(1, V)
    lg[0, 2] = 10.0
    assert sample(lg.clone(), [row(out=[], stop_ids=[2], temperature=0, min_new_tokens=2)], G).next_ids != [2]
    assert sample(lg.clone(), [row(out=[5, 6], stop_ids=[2], temperature=0, min_new_tokens=2)], G).next_ids == [2]


def test_logprobs_chosen_and_top():
    lg = logits_(6)
    res = sample(lg.clone(), [row(temperature=0, lp=True, top=3)], G)
    ref = torch.log_softmax(lg[0], -1)
    assert math.isclose(res.logprobs[0], float(ref.max()), rel_tol=1e-5)
    assert [t for _, t in res.top_logprobs[0]] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2),
    ("max_new_tokens", -1), ("n", 0), ("stop", 3), ("stop_token_ids", ["a"]), ("seed", "x"),
    ("json_schema", "{not json"), ("bogus_field", 1), ("temperature", "hot"),
])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.from_dict({field: value})
