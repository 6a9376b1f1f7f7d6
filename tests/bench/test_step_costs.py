"""bench.step_costs: a step's parts timed on a real engine, and the cost of its call's arguments alone."""

from __future__ import annotations

from bench import step_costs


def test_parts_and_arguments_leave_the_engine_serving(smollm2_engine):
    engine = smollm2_engine
    prompts = [list(range(100, 140)), list(range(200, 240))]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    engine.scheduler.flush_cache()
    before = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]

    engine.scheduler.flush_cache()
    parts = step_costs.step_parts(engine, prompts, params)
    assert set(parts) == {*step_costs.PARTS, "host"}
    assert all(parts[p] > 0 for p in step_costs.PARTS)
    assert parts["step"] > max(parts["call"], parts["wait"], parts["build"])
    assert "_step" not in vars(engine.scheduler) and "step" not in vars(engine.scheduler.runner)  # unwrapped
    assert engine.scheduler.cfg.overlap_schedule  # back on

    args = step_costs.argument_costs(engine, len(prompts))
    assert args["weights"] == len(engine.scheduler.runner._params_flat) > 100
    assert args["with_weights_us"] > 0 and args["without_weights_us"] > 0

    # the pools went through the trivial program (donated) and back: the engine serves as before
    engine.scheduler.flush_cache()
    assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == before
