"""SimModelRunner: tokens from content, the virtual GPU timeline, and --time-scale."""

import time

import pytest

from inference_worker.engine.types import SamplingParams, ScheduledSequence, StepBatch
from inference_worker.sim.latency_model import LatencyModel
from inference_worker.sim.profile import load_profile
from inference_worker.sim.runner import SimModelRunner
from inference_worker.sim.tokenizer import EOS_ID, SimTokenizer

GREEDY = SamplingParams(max_tokens=100, temperature=0.0)


def seq(seq_id, tokens, computed, new, needs_sample=True, sampling=GREEDY, prefill=False):
    return ScheduledSequence(
        seq_id=seq_id, token_ids=tokens, num_computed_tokens=computed, num_new_tokens=new,
        block_table=[0], sampling=sampling, needs_sample=needs_sample, is_prefill=prefill,
    )


class FakeTime:
    """A clock that only moves when the runner sleeps or the test says so."""

    def __init__(self):
        self.now = 100.0
        self.tick = 0.0  # how far each clock read moves time (Python work inside a step)
        self.sleeps = []

    def clock(self):
        self.now += self.tick
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def make_runner(profile="tiny", time_scale=1.0, fake=None, mean_output_tokens=None):
    p = load_profile(profile)
    tok = SimTokenizer()
    kwargs = {"sleep": fake.sleep, "clock": fake.clock} if fake else {}
    runner = SimModelRunner(LatencyModel(p.latency), tok.generation_token_ids, p.engine.block_size,
                            p.num_kv_blocks, time_scale, mean_output_tokens, **kwargs)
    return runner, tok


def test_one_token_per_sequence_that_needs_a_sample():
    runner, tok = make_runner(fake=FakeTime())
    prompt = tok.encode("The quick brown fox jumps over the lazy dog")
    batch = StepBatch([
        seq(1, prompt, 0, 4, needs_sample=False, prefill=True),  # non-final prefill chunk
        seq(2, prompt, 0, len(prompt), prefill=True),
        seq(3, [*prompt, 500], len(prompt), 1),
    ])
    out = runner.execute(batch)
    assert out[0] is None
    assert out[1] in tok.generation_token_ids and out[2] in tok.generation_token_ids


def test_tokens_depend_only_on_content():
    a, tok = make_runner(fake=FakeTime())
    b, _ = make_runner(fake=FakeTime())
    prompt = tok.encode("Tell me a story about a cluster of workers")
    alone = a.execute(StepBatch([seq(1, prompt, 0, len(prompt), prefill=True)]))[0]
    other = tok.encode("Something else entirely")
    batched = b.execute(StepBatch([
        seq(7, other, 0, len(other), prefill=True),
        seq(9, prompt, len(prompt) - 5, 5, prefill=True),  # e.g. after a prefix-cache hit
    ]))[1]
    assert alone == batched
    # Generating a few tokens one by one gives a readable, deterministic continuation.
    tokens = list(prompt)
    for _ in range(8):
        tokens.append(a.execute(StepBatch([seq(1, tokens, len(tokens) - 1, 1)]))[0])
    text = tok.decode(tokens[len(prompt):])
    assert len(text.split()) >= 4 and text.isascii()


def test_natural_eos_only_when_not_ignored():
    runner, _ = make_runner(fake=FakeTime(), mean_output_tokens=4)
    ignoring = SamplingParams(max_tokens=100, ignore_eos=True)
    outs, ignored = [], []
    for i in range(400):
        tokens = [1, 300 + i, 400 + i]
        outs.append(runner.execute(StepBatch([seq(1, tokens, 2, 1)]))[0])
        ignored.append(runner.execute(StepBatch([seq(1, tokens, 2, 1, sampling=ignoring)]))[0])
    assert 50 < outs.count(EOS_ID) < 150  # ~1 in 4
    assert EOS_ID not in ignored
    never, _ = make_runner(fake=FakeTime())  # no mean_output_tokens: never EOS
    assert all(never.execute(StepBatch([seq(1, [1, i, i], 2, 1)]))[0] != EOS_ID for i in range(400))


def test_min_tokens_holds_eos_back_and_logprobs_report_the_modelled_odds():
    import math

    runner, _ = make_runner(fake=FakeTime(), mean_output_tokens=4)
    params = SamplingParams(max_tokens=100, min_tokens=5, logprobs=2)
    held, free = [], []
    for i in range(400):
        tokens = [1, 300 + i, 400 + i]
        before = seq(1, tokens, 2, 1, sampling=params)
        before.num_output_tokens = 4  # the 5th token: still under min_tokens
        after = seq(1, tokens, 2, 1, sampling=params)
        after.num_output_tokens = 5
        held.append((runner.execute(StepBatch([before]))[0], before.sampled_logprobs))
        free.append((runner.execute(StepBatch([after]))[0], after.sampled_logprobs))
    assert EOS_ID not in [t for t, _ in held]
    assert 50 < [t for t, _ in free].count(EOS_ID) < 150
    for token, lp in held:  # EOS cannot come out: the word is certain
        assert lp.logprob == 0.0 and lp.top == ((token, 0.0),)
    for token, lp in free:  # the word at 3/4, then EOS at 1/4
        (word, word_lp), (eos, eos_lp) = lp.top
        assert eos == EOS_ID and word != EOS_ID
        assert (word_lp, eos_lp) == (pytest.approx(math.log(0.75)), pytest.approx(math.log(0.25)))
        assert lp.logprob == (eos_lp if token == EOS_ID else word_lp)


def test_steps_chain_on_a_virtual_timeline_absorbing_engine_overhead():
    fake = FakeTime()
    runner, _ = make_runner(fake=fake)
    model = runner.latency
    credit = model.params.step_overhead_s
    batch = StepBatch([seq(1, list(range(1, 60)), 58, 1)])
    d = model.step_time_raw(1, 1, 59, 59)

    runner.execute(batch)  # first step: credited the overhead, sleeps the rest
    assert fake.sleeps[-1] == pytest.approx(d - credit)
    end1 = fake.now

    fake.now += credit / 2  # engine Python time below the credit: fully absorbed
    runner.execute(batch)
    assert fake.now == pytest.approx(end1 + d)
    end2 = fake.now

    fake.now += credit * 3  # engine slower than the modelled overhead: only the credit is absorbed
    runner.execute(batch)
    assert fake.now == pytest.approx(end2 + 3 * credit - credit + d)
    assert runner.stats.gap_s == pytest.approx(2 * credit)
    assert runner.stats.late_steps == 0

    fake.tick = 2 * d  # the step's own work outlasts its modelled time: it ends late
    runner.execute(batch)
    assert runner.stats.late_steps == 1 and runner.lag_fraction > 0
    assert runner.stats.steps == 4


def test_empty_batch_takes_no_time():
    fake = FakeTime()
    runner, _ = make_runner(fake=fake)
    assert runner.execute(StepBatch([])) == []
    assert fake.sleeps == [] and runner.stats.steps == 0 and runner.stats.late_steps == 0


def test_time_scale_stretches_real_step_time():
    """Ratio of wall times measured in one run: steps at scale 4 take ~4x those at scale 1."""
    batch = StepBatch([seq(i, list(range(1, 200)), 198, 1) for i in range(8)])

    def wall(scale, steps=15):
        runner, _ = make_runner(time_scale=scale)
        start = time.perf_counter()
        for _ in range(steps):
            runner.execute(batch)
        return time.perf_counter() - start

    ratio = wall(4.0) / wall(1.0)
    assert 3.0 < ratio < 5.0


def test_idle_time_is_not_a_stretch_of_the_timeline():
    """The engine says when it goes idle (LLMEngine.record_idle): the wait for the next
    request is not engine time, so it does not count in gap_s (sim:stretch_seconds_total)."""
    fake = FakeTime()
    runner, _ = make_runner(fake=fake)
    credit = runner.latency.params.step_overhead_s
    batch = StepBatch([seq(1, list(range(1, 60)), 58, 1)])
    runner.execute(batch)
    runner.idle()
    fake.now += 10.0  # nothing to run for ten seconds
    runner.execute(batch)
    assert runner.stats.gap_s == 0.0
    fake.now += credit * 3  # busy: the engine's Python time past the credit is a stretch
    runner.execute(batch)
    assert runner.stats.gap_s == pytest.approx(2 * credit)


def _answer(runner, prompt, length, sampling=GREEDY, seq_id=1):
    """`length` tokens decoded one by one (the engine's view: prompt, then outputs)."""
    tokens = list(prompt)
    prefill = seq(seq_id, tokens, 0, len(tokens), sampling=sampling, prefill=True)
    out = [runner.execute(StepBatch([prefill]))[0]]
    while len(out) < length and out[-1] != EOS_ID:
        tokens.append(out[-1])
        step = seq(seq_id, tokens, len(tokens) - 1, 1, sampling=sampling)
        step.num_output_tokens = len(out)
        out.append(runner.execute(StepBatch([step]))[0])
    return out


def test_prompts_that_end_alike_get_answers_of_their_own():
    """A chat prompt always ends with the template's closing tokens (`[/INST]`): prompts of one
    length that differ before their last two tokens must not all get the same answer, as they
    would if only the last two tokens and the position chose the next token."""
    runner, tok = make_runner(fake=FakeTime())
    questions = ("What is the capital of France?", "Write me a poem about the sea", "Who are you, my dear?")
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) == 1 and len({tuple(p[-2:]) for p in prompts}) == 1
    answers = {tuple(_answer(runner, p, 8, seq_id=i)) for i, p in enumerate(prompts)}
    assert len(answers) == len(prompts)


def test_answer_lengths_of_prompts_that_end_alike_are_geometric():
    """With mean_output_tokens, each prompt's length is its own draw (1 in 4 ends at once
    here), not one fate shared by every prompt of that length and ending."""
    runner, _ = make_runner(fake=FakeTime(), mean_output_tokens=4)
    sampled = SamplingParams(max_tokens=100)
    firsts = [runner.execute(StepBatch([seq(i, [1, 300 + i, 7, 8], 0, 4, sampling=sampled, prefill=True)]))[0]
              for i in range(400)]
    assert 50 < firsts.count(EOS_ID) < 150


def test_a_prompt_gets_the_same_answer_again_and_after_a_recompute():
    runner, tok = make_runner(fake=FakeTime(), mean_output_tokens=1000)
    prompt = tok.encode("Tell me a story about a cluster of workers")
    answer = _answer(runner, prompt, 30, seq_id=5)
    assert len(answer) == 30
    assert _answer(runner, prompt, 30, seq_id=9) == answer
    # Preempted after 10 tokens: the whole sequence is computed again as a prefill.
    tokens = [*prompt, *answer[:10]]
    resumed = seq(5, tokens, 0, len(tokens), prefill=True)
    resumed.num_output_tokens = 10
    assert runner.execute(StepBatch([resumed]))[0] == answer[10]


def test_sampled_choices_of_one_request_differ_greedy_ones_do_not():
    """n > 1: vLLM draws each choice on its own (a seeded one from seed + index, which the
    server already gives it), so sampled choices differ; greedy ones are the same answer."""
    from dataclasses import replace

    from inference_worker.engine.types import ParallelSampling

    runner, tok = make_runner(fake=FakeTime())
    prompt = tok.encode("Give me two ideas")
    sampled = SamplingParams(max_tokens=100, n=2, parallel=ParallelSampling(2, 2))
    greedy = replace(sampled, temperature=0.0, parallel=ParallelSampling(2, 2))
    assert _answer(runner, prompt, 8, sampled, seq_id=3) != _answer(runner, prompt, 8, sampled, seq_id=4)
    assert _answer(runner, prompt, 8, greedy, seq_id=3) == _answer(runner, prompt, 8, greedy, seq_id=4)


def _prompt_logprobs(runner, prompt, sampling, seq_id=1):
    """The prompt logprobs of one whole-prompt prefill, and its sampled first token."""
    prefill = seq(seq_id, list(prompt), 0, len(prompt), sampling=sampling, prefill=True)
    token = runner.execute(StepBatch([prefill]))[0]
    return prefill.prompt_logprobs, token


def test_prompt_logprobs_are_the_prompts_alone_the_seed_picks_only_samples():
    """A model's prompt logprobs come from its forward pass over the prompt: a sampling seed
    cannot change them. The seed still picks the sampled token."""
    runner, tok = make_runner(fake=FakeTime())
    prompt = tok.encode("The three primary colors are red, yellow and blue")
    found = {}
    for seq_id, seed in enumerate((None, 0, 1, 7, 12345)):
        sampling = SamplingParams(max_tokens=4, seed=seed, prompt_logprobs=3)
        found[seed] = _prompt_logprobs(runner, prompt, sampling, seq_id=seq_id)
    other, _ = make_runner(fake=FakeTime())  # a fresh runner, a greedy request: the same odds
    greedy = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)
    found["greedy"] = _prompt_logprobs(other, prompt, greedy, seq_id=99)
    logprobs = [lp for lp, _ in found.values()]
    assert len(logprobs[0]) == len(prompt) - 1 and all(lp == logprobs[0] for lp in logprobs)
    assert all(entry.top for entry in logprobs[0])  # the modelled word is named at each position
    assert len({token for _, token in found.values()}) > 1  # the seeds still draw their own samples
