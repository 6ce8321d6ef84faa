"""The public API: load / generate / stream / logits, stops, logprobs, validation."""

import math

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.engine.stops import StopMatcher

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_default_model_answers_paris(default_model):
    out = fx_engine.generate(default_model, QUESTION, max_tokens=24)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.usage.prompt_tokens == len(out.prompt_token_ids) > 0
    assert out.usage.completion_tokens == len(out.token_ids)
    assert out.prompt_token_ids[0] == 1  # <|im_start|> from the chat template


def test_stream_concatenates_to_generate(default_model):
    kwargs = dict(max_tokens=20, temperature=0.8, seed=7)
    deltas = list(fx_engine.stream(default_model, QUESTION, **kwargs))
    out = fx_engine.generate(default_model, QUESTION, **kwargs)
    assert all(isinstance(d, str) for d in deltas)
    assert "".join(deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == list(out.token_ids)
    assert deltas[-1].finish_reason == out.finish_reason and deltas[-1].usage is not None


def test_seeded_sampling_is_reproducible(default_model):
    a = fx_engine.generate(default_model, QUESTION, max_tokens=16, temperature=1.0, seed=3)
    b = fx_engine.generate(default_model, QUESTION, max_tokens=16, temperature=1.0, seed=3)
    c = fx_engine.generate(default_model, QUESTION, max_tokens=16, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_max_tokens_gives_length(default_model):
    out = fx_engine.generate(default_model, "Once upon a time", max_tokens=5)
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stop_string_never_leaks(default_model):
    full = fx_engine.generate(default_model, QUESTION, max_tokens=24).text
    assert "Paris" in full
    deltas = list(fx_engine.stream(default_model, QUESTION, max_tokens=24, stop=["Paris"]))
    text = "".join(deltas)
    assert text == full[: full.index("Paris")]
    assert deltas[-1].finish_reason == "stop"
    assert not any("Par" in d for d in deltas)


def test_logprobs(default_model):
    out = fx_engine.generate(default_model, QUESTION, max_tokens=6, logprobs=3)
    assert len(out.logprobs) == len(out.token_ids)
    full = fx_engine.logits(default_model, list(out.prompt_token_ids) + list(out.token_ids))
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: chosen is the top
        assert lp.top[0][2] >= lp.top[1][2] >= lp.top[2][2]
        # the reported logprob is log_softmax of the teacher-forced logits at that position
        row = full[len(out.prompt_token_ids) - 1 + i]
        ref = (row - mx.logsumexp(row))[lp.token_id].item()
        assert math.isclose(lp.logprob, ref, abs_tol=2e-3)


def test_logits_api(tiny_model):
    ids = tiny_model.tokenizer.encode("hello world, hello world")
    lg = fx_engine.logits(tiny_model, ids)
    assert lg.shape == (len(ids), tiny_model.config.vocab_size) and lg.dtype == mx.float32
    # chunking does not change the result beyond rounding
    assert mx.allclose(lg, fx_engine.logits(tiny_model, ids, chunk=4), atol=1e-4)
    with pytest.raises(ValueError, match="token_ids"):
        fx_engine.logits(tiny_model, [])
    with pytest.raises(ValueError, match="token_ids"):
        fx_engine.logits(tiny_model, [10**9])


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": -1}, "top_k"),
        ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ],
)
def test_invalid_parameters_name_the_field(tiny_model, kwargs, name):
    with pytest.raises(ValueError, match=name):
        fx_engine.generate(tiny_model, "hi", **kwargs)


def test_bad_prompts(tiny_model):
    with pytest.raises(ValueError, match="prompt"):
        fx_engine.generate(tiny_model, "")
    with pytest.raises(ValueError, match="prompt"):
        fx_engine.generate(tiny_model, [10**8])
    with pytest.raises(ValueError, match="role"):
        fx_engine.generate(tiny_model, [{"content": "no role"}])
    with pytest.raises(ValueError, match="context"):
        fx_engine.generate(tiny_model, [5] * 5000)


def test_token_id_prompt_and_penalties_run(tiny_model):
    out = fx_engine.generate(tiny_model, [5, 6, 7], max_tokens=8, temperature=0.7, seed=1,
                             repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                             logit_bias={3: -100.0}, top_k=20, min_p=0.05)
    assert len(out.token_ids) <= 8 and 3 not in out.token_ids


def test_cache_grows_past_its_first_bucket(tiny_model):
    """A generation longer than the initial capacity bucket (256) keeps going correctly."""
    ids = tiny_model.tokenizer.encode("The quick brown fox")
    out = fx_engine.generate(tiny_model, ids, max_tokens=300)
    assert len(out.token_ids) == 300 or out.finish_reason == "stop"
    # teacher-forced greedy check of the tail: each generated token is the argmax
    seq = list(ids) + list(out.token_ids)
    lg = fx_engine.logits(tiny_model, seq)
    pred = lg.argmax(-1).tolist()
    n = len(ids)
    agree = sum(pred[n - 1 + i] == t for i, t in enumerate(out.token_ids))
    assert agree >= len(out.token_ids) - 2  # near ties may flip across chunkings


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abcXY \n", max_size=40),
    stops=st.lists(st.text(alphabet="abcXY", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_stop_matcher_property(text, stops, cuts):
    m = StopMatcher(stops)
    bounds = sorted(set([0, len(text)] + [c for c in cuts if c <= len(text)]))
    out = "".join(m.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])) + m.flush()
    # Oracle: after each piece, the text so far is searched; at the first piece that
    # completes any stop, the output ends where the earliest-starting completed stop starts
    # (a longer stop that started earlier but is not complete yet cannot count: e.g. text
    # "XXa" + "X" with stops "a" and "XaX" stops at "XX").
    expected = text
    for b in bounds[1:]:
        starts = [i for i in (text[:b].find(s) for s in stops) if i >= 0]
        if starts:
            expected = text[: min(starts)]
            break
    assert out == expected
    assert m.stopped == (expected != text or any(s in text for s in stops))
    assert not any(s in out for s in stops)


def test_held_back_text_never_loses_token_ids(default_model):
    """Tokens whose text is held back (a stop-string prefix) still reach token_ids."""
    full = fx_engine.generate(default_model, QUESTION, max_tokens=12)
    out = fx_engine.generate(default_model, QUESTION, max_tokens=12, stop=["Paris is not"])
    assert out.token_ids == full.token_ids
    assert out.usage.completion_tokens == len(out.token_ids)


def test_validation_happens_at_call_time(tiny_model):
    with pytest.raises(ValueError, match="max_tokens"):
        fx_engine.stream(tiny_model, "hi", max_tokens=-1)  # no iteration needed
    with pytest.raises(ValueError, match="stop"):
        fx_engine.stream(tiny_model, "hi", stop=5)
    with pytest.raises(ValueError, match="logprobs"):
        fx_engine.stream(tiny_model, "hi", logprobs=2.5)
    with pytest.raises(ValueError, match="prefill_chunk"):
        fx_engine.stream(tiny_model, "hi", prefill_chunk=0)
    with pytest.raises(ValueError, match="dtype"):
        fx_engine.load(tiny_model.path, dtype="fp16")


def test_padded_vocabulary_tokens_do_not_crash(tiny_folder):
    """A model vocabulary larger than the tokenizer's: ids past it decode to no text."""
    m = fx_engine.load(tiny_folder("llama", vocab_size=1024))
    assert m.tokenizer.vocab_size < 1024
    out = fx_engine.generate(m, [5, 6, 7], max_tokens=4, logit_bias={1000: 100.0})
    assert out.token_ids == (1000,) * 4 and out.text == ""


def test_prompt_filling_the_context_still_yields_one_token(tiny_folder):
    m = fx_engine.load(tiny_folder("llama", max_position_embeddings=64))
    out = fx_engine.generate(m, [5] * 64, max_tokens=1)
    assert len(out.token_ids) <= 1 and out.finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="context"):
        fx_engine.generate(m, [5] * 64, max_tokens=2)
