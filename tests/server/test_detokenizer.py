"""IncrementalDetokenizer alone, with the default model's tokenizer (no server, no model)."""

import pytest

from strand.runtime.detokenizer import DetokenizerManager, IncrementalDetokenizer
from strand.runtime.io_struct import ReqOutput
from strand.runtime.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


TEXTS = ["Hello world, this is plain.", "héllo 中文 😀 mixed — text ✓", "😀😀😀 🇫🇷 end"]


def feed(det, ids, step=1):
    shown = []
    for i in range(0, len(ids), step):
        shown.append(det.append(ids[i : i + step]))
    return shown


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_text_equals_full_decode(tok, text, step):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, prompt_ids=tok.encode("User says:"))
    shown = feed(det, ids, step)
    for a, b in zip(shown, shown[1:]):
        assert b.startswith(a)  # never shrinks, never rewrites
    assert all("\ufffd" not in s for s in shown)  # a split character is held back
    assert det.finish() == tok.decode(ids)


def test_skip_special_tokens(tok):
    ids = tok.encode("Hi there") + [tok.eos_token_id]
    det = IncrementalDetokenizer(tok, skip_special_tokens=True)
    feed(det, ids)
    assert det.finish() == "Hi there"
    det = IncrementalDetokenizer(tok, skip_special_tokens=False)
    feed(det, ids)
    assert det.finish() == "Hi there" + tok.decode([tok.eos_token_id])


def test_stop_string_held_back_and_trimmed(tok):
    ids = tok.encode("The answer is 42. END of story")
    det = IncrementalDetokenizer(tok, stop=["END"])
    shown = feed(det, ids)
    assert all("E" not in s.split("42.")[-1] for s in shown)  # partial stop never shown
    final = det.finish(stop_str="END")
    assert final == "The answer is 42. "
    for s in shown:
        assert final.startswith(s) or s.startswith(final)
    det = IncrementalDetokenizer(tok, stop=["END"], no_stop_trim=True)
    feed(det, ids)
    assert det.finish(stop_str="END") == "The answer is 42. END of story"


def test_stop_token_trimmed(tok):
    stop_id = tok.encode(" stop")[0]
    ids = tok.encode("go go") + [stop_id]
    det = IncrementalDetokenizer(tok)
    feed(det, ids)
    assert det.finish(matched_token=stop_id) == "go go"


def test_manager_logprob_text_and_meta(tok):
    m = DetokenizerManager(tok)
    ids = tok.encode("ab cd")
    first = m.process(ReqOutput("r", ids[:1], prompt_tokens=3, completion_tokens=1,
                                input_token_logprobs=[(None, 1), (-1.0, 2)],
                                output_token_logprobs=[(-0.5, ids[0])]))
    assert first.meta_info["input_token_logprobs"] == [[None, 1, None], [-1.0, 2, None]]
    assert not first.finished and first.meta_info["finish_reason"] is None
    last = m.process(ReqOutput("r", ids[1:], finish_reason={"type": "length", "length": len(ids)},
                               prompt_tokens=3, completion_tokens=len(ids)))
    assert last.finished and last.text == "ab cd" and last.output_ids == ids
    assert "r" not in m.states


def test_manager_adds_logprob_text_when_asked(tok):
    from strand.runtime.detokenizer import DetokenizeSpec

    m = DetokenizerManager(tok)
    ids = tok.encode(" Paris")
    m.register(DetokenizeSpec(rid="s", return_text_in_logprobs=True, stop=["."]))
    out = m.process(ReqOutput("s", ids, finish_reason={"type": "length", "length": 1}, prompt_tokens=1,
                              completion_tokens=1, output_token_logprobs=[(-0.1, ids[0])],
                              output_top_logprobs=[[(-0.1, ids[0]), (-3.0, 13)]]))
    assert out.meta_info["output_token_logprobs"] == [[-0.1, ids[0], " Paris"]]
    assert out.meta_info["output_top_logprobs"][0][1] == [-3.0, 13, tok.decode([13])]
    assert "s" not in m.specs
