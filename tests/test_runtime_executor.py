"""The plan executor (clock per instruction, slot and SMs per partition) and the megatron-core hook."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kareus.plan.model import ExecutionPlan, InstructionPlan, PartitionSetting, StagePlan
from kareus.runtime.executor import PlanCoverageError, PlanExecutor
from kareus.runtime.megatron import MicrobatchTracker, PlanMismatchError, UnsupportedScheduleError, plan_hooks


class FakeController:
    """Records the clock calls a frequency controller would get."""

    def __init__(self) -> None:
        self.calls: list = []

    def set(self, mhz: int) -> None:
        self.calls.append(mhz)

    def reset(self) -> None:
        self.calls.append("reset")


def _ins(direction: str, mbs: tuple[int, ...], mhz: int, slot: str, sms: int) -> InstructionPlan:
    parts = (PartitionSetting(f"{direction}_attn", slot, sms, 2), PartitionSetting(f"{direction}_mlp", "sequential", 4, 2))
    return InstructionPlan(0, direction, mbs, mhz, 0.01, 1.0, parts)


def _plan(num_microbatches: int = 4) -> ExecutionPlan:
    stage0 = StagePlan(0, (_ins("fwd", (0, 1), 1410, "attn_0", 8), _ins("fwd", (2, 3), 1200, "norm_0", 12),
                           _ins("bwd", (0, 1, 2, 3), 1305, "linear_1", 16)))
    stage1 = StagePlan(1, (_ins("fwd", (0, 1, 2, 3), 1005, "attn_0", 8), _ins("bwd", (0, 1, 2, 3), 1005, "attn_0", 8)))
    return ExecutionPlan(1, "h", "sim", "kareus", "1f1b", 0, 2, num_microbatches, 2, 85.0, 1.0, 100.0, 50.0,
                         (stage0, stage1))


def test_clock_switches_only_when_the_instruction_clock_changes():
    ctl = FakeController()
    ex = PlanExecutor(_plan(), ctl, stage=0)
    for mb, d in [(0, "fwd"), (1, "fwd"), (0, "bwd"), (2, "fwd"), (1, "bwd"), (3, "fwd"), (2, "bwd"), (3, "bwd")]:
        ex.begin(mb, d)
    assert ctl.calls == [1410, 1305, 1200, 1305, 1200, 1305]  # f1 and b3 keep the clock already locked
    assert [(s.microbatch, s.direction, s.mhz) for s in ex.switches] == [
        (0, "fwd", 1410), (0, "bwd", 1305), (2, "fwd", 1200), (1, "bwd", 1305), (3, "fwd", 1200), (2, "bwd", 1305)]
    assert ex.instructions == 8 and ex.switch_count == 6


def test_a_long_run_keeps_the_latest_switches_not_every_one():
    """Every switch was kept in a list: at 32 switches an iteration, 0.45 GB a rank over 100k iterations."""
    from kareus.runtime.executor import SWITCHES_KEPT

    ex = PlanExecutor(_plan(), FakeController(), stage=0, sync=lambda: None)
    order = [(0, "fwd"), (0, "bwd"), (2, "fwd")]  # three switches an "iteration"
    for _ in range(SWITCHES_KEPT):
        for mb, d in order:
            ex.begin(mb, d)
        ex.reset()
    assert ex.switch_count == 3 * SWITCHES_KEPT and len(ex.switches) == SWITCHES_KEPT
    assert ex.switches[-1].microbatch == 2


def test_device_is_synchronised_before_each_clock_switch_and_only_then():
    log: list = []
    ctl = FakeController()
    ctl.calls = log  # one log for both: the order of sync and set is what matters
    ex = PlanExecutor(_plan(), ctl, stage=0, sync=lambda: log.append("sync"))
    for mb, d in [(0, "fwd"), (1, "fwd"), (0, "bwd"), (2, "fwd"), (3, "fwd")]:
        ex.begin(mb, d)
    # f1 and f3 keep the locked clock: no sync (it would stall the queue for nothing)
    assert log == ["sync", 1410, "sync", 1305, "sync", 1200]


def test_default_sync_is_a_no_op_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the default is torch.cuda.synchronize")
    ex = PlanExecutor(_plan(), FakeController(), stage=0)
    assert ex.sync() is None
    ex.begin(0, "fwd")


def test_partition_settings_follow_the_current_instruction():
    ex = PlanExecutor(_plan(), FakeController(), stage=0)
    with pytest.raises(RuntimeError, match="begin"):
        ex.slot("fwd_attn")
    ex.begin(1, "fwd")
    assert (ex.slot("fwd_attn"), ex.sms("fwd_attn")) == ("attn_0", 8)
    assert ex.setting("fwd_mlp").slot == "sequential"
    ex.begin(2, "fwd")
    assert (ex.slot("fwd_attn"), ex.sms("fwd_attn")) == ("norm_0", 12)
    with pytest.raises(PlanCoverageError, match="no setting for partition 'bwd_attn'"):
        ex.sms("bwd_attn")
    with pytest.raises(PlanCoverageError, match="microbatch 7"):
        ex.begin(7, "fwd")


def test_a_failed_clock_switch_leaves_no_instruction_current():
    """The lock for microbatch 2 failed, and a caller that caught the error still read microbatch 0's
    slot and SMs, as if microbatch 2 ran with them."""
    class FailsAt1200(FakeController):
        def set(self, mhz: int) -> None:
            if mhz == 1200:
                raise RuntimeError("cannot lock 1200 MHz")
            super().set(mhz)

    ex = PlanExecutor(_plan(), FailsAt1200(), stage=0)
    ex.begin(0, "fwd")
    with pytest.raises(RuntimeError, match="cannot lock"):
        ex.begin(2, "fwd")
    assert ex.current is None
    with pytest.raises(RuntimeError, match="no instruction is running"):
        ex.slot("fwd_attn")


def test_an_instruction_in_megatrons_layout_says_so():
    megatron = InstructionPlan(0, "bwd", (0, 1, 2, 3), 1410, 0.01, 1.0,
                               (PartitionSetting("megatron:bwd_attn", "sequential", 16, 2),))
    stage0 = StagePlan(0, (_ins("fwd", (0, 1, 2, 3), 1410, "attn_0", 8), megatron))
    plan = ExecutionPlan(1, "h", "sim", "kareus", "1f1b", 0, 1, 4, 2, 85.0, 1.0, 100.0, 50.0, (stage0,))
    ex = PlanExecutor(plan, FakeController(), stage=0)
    ex.begin(0, "fwd")
    assert not ex.megatron_layout()
    ex.begin(0, "bwd")
    assert ex.megatron_layout() and ex.setting("megatron:bwd_attn").slot == "sequential"


def test_clocks_are_reset_on_exit_even_after_an_error_and_relocked_after():
    ctl = FakeController()
    with pytest.raises(ZeroDivisionError):
        with PlanExecutor(_plan(), ctl, stage=1) as ex:
            ex.begin(0, "fwd")
            1 / 0
    assert ctl.calls == [1005, "reset"]
    ex.begin(1, "bwd")  # after a reset the executor locks again even for the same clock
    assert ctl.calls == [1005, "reset", 1005]
    with pytest.raises(ValueError, match="stage 2"):
        PlanExecutor(_plan(), ctl, stage=2)


def test_the_last_instructions_kernels_finish_at_its_clock_before_the_reset():
    log: list = []
    ctl = FakeController()
    ctl.calls = log
    ex = PlanExecutor(_plan(), ctl, stage=1, sync=lambda: log.append("sync"))
    ex.reset()  # nothing locked: nothing to wait for
    ex.begin(0, "fwd")
    ex.reset()
    assert log == ["reset", "sync", 1005, "sync", "reset"]


def test_a_reset_that_fails_while_an_error_unwinds_does_not_replace_that_error(caplog):
    class Failing(FakeController):
        def reset(self) -> None:
            raise RuntimeError("NVML: GPU is lost")

    with pytest.raises(ZeroDivisionError):
        with PlanExecutor(_plan(), Failing(), stage=1, sync=lambda: None) as ex:
            ex.begin(0, "fwd")
            1 / 0
    assert "could not reset the locked GPU clocks after ZeroDivisionError (RuntimeError: NVML: GPU is lost)" in caplog.text
    with pytest.raises(RuntimeError, match="GPU is lost"):  # alone, the failure is the error
        with PlanExecutor(_plan(), Failing(), stage=1, sync=lambda: None) as ex:
            ex.begin(0, "fwd")


def _broken_sync() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_the_clocks_are_given_back_when_the_device_sync_fails():
    """After a sticky CUDA error every synchronize raises: the reset waited on it and never unlocked."""
    ctl = FakeController()
    ex = PlanExecutor(_plan(), ctl, stage=1, sync=lambda: None)
    ex.begin(0, "fwd")
    ex.sync = _broken_sync
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ex.reset()
    assert ctl.calls == [1005, "reset"]


def test_leaving_the_hooks_on_a_training_error_resets_the_clocks_and_keeps_that_error(caplog):
    """The hooks' reset raised the failing sync's error over the training step's own."""
    ctl = FakeController()
    fake = _fake_schedules([])
    ex = PlanExecutor(_plan(), ctl, stage=0, sync=lambda: None)
    with pytest.raises(ZeroDivisionError):
        with plan_hooks(ex, fake):
            fake.forward_step("func", current_microbatch=0)
            ex.sync = _broken_sync  # the step's error left CUDA broken
            1 / 0
    assert ctl.calls == [1410, "reset"]
    assert "after ZeroDivisionError (RuntimeError: CUDA error: an illegal memory access" in caplog.text


def test_hooks_left_normally_inside_an_except_handler_raise_a_failed_reset():
    """The hooks read sys.exc_info(), which inside an outer except handler (a retry path) names that
    handled error: a failed reset was logged, not raised, and training went on with the GPU locked."""
    ctl = FakeController()
    fake = _fake_schedules([])
    ex = PlanExecutor(_plan(), ctl, stage=0, sync=lambda: None)
    try:
        raise KeyError("an earlier, handled error")
    except KeyError:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            with plan_hooks(ex, fake):
                fake.forward_step("func", current_microbatch=0)
                ex.sync = _broken_sync


def test_run_partition_hands_the_knobs_to_the_backend():
    calls = []
    backend = SimpleNamespace(run_partition=lambda p, slot, sms: calls.append((p.key, slot, sms)))
    ex = PlanExecutor(_plan(), FakeController(), stage=0, backend=backend)
    ex.begin(0, "bwd")
    ex.run_partition(SimpleNamespace(key="bwd_attn"))
    assert calls == [("bwd_attn", "linear_1", 16)]


def test_tracker_pairs_backwards_with_forwards_in_order():
    t = MicrobatchTracker()
    assert [t.forward(0), t.forward(1), t.backward(), t.forward(2), t.backward(), t.backward()] == [0, 1, 0, 2, 1, 2]
    with pytest.raises(RuntimeError, match="no forward"):
        t.backward()
    t.forward(0), t.forward(1)  # an eval pass: forwards only
    assert t.forward(0) == 0 and t.backward() == 0  # the next iteration starts fresh


def _one_f_one_b(stage: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage (warm-up forwards, steady 1F1B, cool-down backwards)."""
    warm = min(num_stages - stage - 1, m)
    order = [("f", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        order += [("f", f), ("b", b)]
        f, b = f + 1, b + 1
    order += [("b", i) for i in range(b, m)]
    return order


def test_hook_switches_the_clock_before_each_step_of_a_1f1b_schedule():
    calls: list = []
    ctl = FakeController()
    ex = PlanExecutor(_plan(), ctl, stage=0)
    fake = SimpleNamespace(
        forward_step=lambda *a, **kw: calls.append(("f", kw["current_microbatch"], ex.current.freq_mhz)) or ("out", 1),
        backward_step=lambda *a, **kw: calls.append(("b", ex.current.microbatches, ex.current.freq_mhz)))
    originals = (fake.forward_step, fake.backward_step)
    with plan_hooks(ex, fake):
        for kind, mb in _one_f_one_b(stage=0, num_stages=2, m=4):
            if kind == "f":
                assert fake.forward_step("func", current_microbatch=mb) == ("out", 1)
            else:
                fake.backward_step(None, None, None, None, None)
    assert (fake.forward_step, fake.backward_step) == originals  # restored
    assert [c[2] for c in calls] == [1410, 1410, 1305, 1200, 1305, 1200, 1305, 1305]
    assert ctl.calls == [1410, 1305, 1200, 1305, 1200, 1305, "reset"]  # clocks given back on leaving the hooks


def _fake_schedules(calls: list) -> SimpleNamespace:
    return SimpleNamespace(forward_step=lambda *a, **kw: calls.append("f"), backward_step=lambda *a, **kw: calls.append("b"))


def test_hook_refuses_the_interleaved_schedule_before_any_clock_switch():
    calls: list = []
    ctl = FakeController()
    fake = _fake_schedules(calls)
    with plan_hooks(PlanExecutor(_plan(), ctl, stage=0), fake):
        fake.forward_step("func", current_microbatch=0, vp_stage=None)  # the non-interleaved schedules
        with pytest.raises(UnsupportedScheduleError, match="interleaved"):
            fake.forward_step("func", current_microbatch=1, vp_stage=0)  # chunk 0 of a virtual pipeline
        with pytest.raises(UnsupportedScheduleError, match="vp_stage=1"):
            fake.forward_step(*["x"] * 12, 1)  # positional, as forward_step's signature allows
    assert calls == ["f"] and ctl.calls == [1410, "reset"]


@pytest.mark.parametrize("flag,value", [("overlap_moe_expert_parallel_comm", True), ("hybrid_context_parallel", True),
                                        ("virtual_pipeline_model_parallel_size", 2)])
def test_hook_refuses_schedules_that_bypass_or_miscount_its_steps(flag, value):
    config = SimpleNamespace(**{flag: value})
    fake = _fake_schedules([])
    originals = (fake.forward_step, fake.backward_step)
    with pytest.raises(UnsupportedScheduleError, match=flag):
        with plan_hooks(PlanExecutor(_plan(), FakeController(), stage=0), fake, config=config):
            pass
    assert (fake.forward_step, fake.backward_step) == originals  # nothing was patched
    ctl = FakeController()
    with plan_hooks(PlanExecutor(_plan(), ctl, stage=0), fake):  # no config given: the first forward tells
        with pytest.raises(UnsupportedScheduleError, match=flag):
            fake.forward_step("func", None, None, 4, None, [], config, current_microbatch=0)
    assert ctl.calls == ["reset"]


def test_a_training_call_is_refused_by_its_models_config_before_the_schedule_runs():
    """Without a config given to plan_hooks, only forward_step checked one, and a schedule that never
    calls it (combined_1f1b under overlap_moe_expert_parallel_comm) trained with no switch and no error."""
    ran: list = []
    fake = _fake_schedules([])
    fake.forward_backward_no_pipelining = lambda **kw: ran.append(kw["forward_only"])
    moe = SimpleNamespace(overlap_moe_expert_parallel_comm=True)
    wrapped_twice = SimpleNamespace(module=SimpleNamespace(module=SimpleNamespace(config=moe)))  # DDP(Float16Module)
    ctl = FakeController()
    with plan_hooks(PlanExecutor(_plan(num_microbatches=4), ctl, stage=0), fake):
        for model in ([SimpleNamespace(config=moe)], wrapped_twice):
            with pytest.raises(UnsupportedScheduleError, match="overlap_moe_expert_parallel_comm"):
                fake.forward_backward_no_pipelining(model=model, num_microbatches=4, forward_only=False)
        fake.forward_backward_no_pipelining(model=[SimpleNamespace(config=moe)], num_microbatches=4, forward_only=True)
    assert ran == [True] and ctl.calls == ["reset"]  # evaluation runs as it is, at the clock it finds


def test_the_interleaved_schedule_is_refused_on_every_rank_before_it_runs():
    """Refused only in the first forward step, the first pipeline rank raised while the others waited in
    a receive from it until the communicator timed out."""
    ran: list = []
    fake = _fake_schedules([])
    fake.forward_backward_pipelining_with_interleaving = lambda **kw: ran.append(kw["forward_only"])
    original = fake.forward_backward_pipelining_with_interleaving
    with plan_hooks(PlanExecutor(_plan(), FakeController(), stage=0), fake):
        with pytest.raises(UnsupportedScheduleError, match="interleaved"):
            fake.forward_backward_pipelining_with_interleaving(model=[], num_microbatches=4, forward_only=False)
        fake.forward_backward_pipelining_with_interleaving(model=[], num_microbatches=4, forward_only=True)
    assert ran == [True] and fake.forward_backward_pipelining_with_interleaving is original


@pytest.mark.parametrize("scope", ["full_iteration", ["full_iteration"], ["attn", "full_iteration"]])
def test_hook_refuses_a_full_iteration_cuda_graph(scope):
    """megatron-core captures forward_backward_func once and replays it: no forward_step runs again, so no
    clock switches, and the first switch's device sync would break the capture."""
    fake = _fake_schedules([])
    for config in (SimpleNamespace(cuda_graph_impl="local", cuda_graph_scope=scope),
                   SimpleNamespace(enable_cuda_graph=True, cuda_graph_scope=scope)):  # older releases spell it so
        with pytest.raises(UnsupportedScheduleError, match="full-iteration CUDA graph"):
            with plan_hooks(PlanExecutor(_plan(), FakeController(), stage=0), fake, config=config):
                pass
    for fine in (SimpleNamespace(cuda_graph_impl="local", cuda_graph_scope=["attn", "mlp"]),  # per layer
                 SimpleNamespace(cuda_graph_impl="none", cuda_graph_scope=scope)):
        with plan_hooks(PlanExecutor(_plan(), FakeController(), stage=0), fake, config=fine):
            pass


def test_hook_checks_the_flags_megatron_core_config_has():
    pytest.importorskip("megatron.core")
    from megatron.core.model_parallel_config import ModelParallelConfig

    ex = PlanExecutor(_plan(), FakeController(), stage=0)
    with plan_hooks(ex, _fake_schedules([]), config=ModelParallelConfig()):
        pass
    for flag in ("overlap_moe_expert_parallel_comm", "hybrid_context_parallel"):
        with pytest.raises(UnsupportedScheduleError, match=flag):
            with plan_hooks(ex, _fake_schedules([]), config=ModelParallelConfig(**{flag: True})):
                pass
    from megatron.core.transformer.enums import CudaGraphScope  # the scope as megatron-core's config holds it

    graphed = SimpleNamespace(cuda_graph_impl="local", cuda_graph_scope=[CudaGraphScope.full_iteration])
    with pytest.raises(UnsupportedScheduleError, match="full-iteration CUDA graph"):
        with plan_hooks(ex, _fake_schedules([]), config=graphed):
            pass


def test_hook_reads_forward_step_arguments_where_megatron_core_puts_them():
    import inspect

    from kareus.runtime import megatron

    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    names = list(inspect.signature(schedules.forward_step).parameters)
    assert names.index("config") == megatron._FORWARD_CONFIG
    assert names.index("current_microbatch") == megatron._FORWARD_MICROBATCH
    assert names.index("vp_stage") == megatron._FORWARD_VP_STAGE


def test_hook_patches_the_functions_megatron_core_schedules_call():
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    ex = PlanExecutor(_plan(), FakeController(), stage=0)
    run = schedules.forward_backward_pipelining_without_interleaving
    orig = schedules.forward_step
    with plan_hooks(ex):
        # the schedule resolves forward_step/backward_step in its module globals at call time
        assert run.__globals__["forward_step"].__wrapped__ is orig
        assert schedules.forward_backward_pipelining_without_interleaving.__wrapped__ is run
        no_pipelining = schedules.forward_backward_no_pipelining.__wrapped__
        assert no_pipelining.__globals__["backward_step"] is schedules.backward_step
        assert schedules.backward_step.__wrapped__ is not None
    assert schedules.forward_step is orig and schedules.forward_backward_pipelining_without_interleaving is run


def test_hook_drives_megatron_core_schedule_on_cpu(monkeypatch):
    """megatron-core's own no-pipelining schedule on a gloo group of one: the clock follows the plan."""
    torch = pytest.importorskip("torch")
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig

    class CpuZeros:  # the schedule allocates its token counter on "cuda"; keep it on the CPU
        def __getattr__(self, name):
            return getattr(torch, name)

        def zeros(self, *a, **kw):
            kw.pop("device", None)
            return torch.zeros(*a, **kw)

    monkeypatch.setattr(schedules, "torch", CpuZeros())
    plan = ExecutionPlan(1, "h", "sim", "kareus", "1f1b", 0, 1, 3, 1, 85.0, 1.0, 1.0, 1.0, (StagePlan(0, (
        InstructionPlan(0, "fwd", (0,), 1410, 0.01, 1.0, (PartitionSetting("fwd_attn", "attn_0", 8),)),
        InstructionPlan(0, "fwd", (1, 2), 1200, 0.01, 1.0, (PartitionSetting("fwd_attn", "norm_0", 12),)),
        InstructionPlan(0, "bwd", (0, 1, 2), 1305, 0.01, 1.0, (PartitionSetting("bwd_attn", "linear_1", 16),)),
    )),))
    ctl = FakeController()
    ex = PlanExecutor(plan, ctl, stage=0)
    seen = []

    def forward_step_func(data, model):
        seen.append(("f", ex.current.freq_mhz, ex.slot("fwd_attn")))
        out = model(next(data)).sum()
        return out, lambda o: (o, {"loss": o.detach()})

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        try:
            parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        except TypeError:  # older megatron-core: no such keyword
            parallel_state.initialize_model_parallel(1, 1)
        model = torch.nn.Linear(4, 1)
        model.config = ModelParallelConfig()
        model.config.fine_grained_activation_offloading = False
        model.model_type = ModelType.encoder_or_decoder
        model.set_input_tensor = lambda t: None
        run = schedules.get_forward_backward_func()
        with plan_hooks(ex) as tracker:
            losses = run(forward_step_func=forward_step_func, data_iterator=iter([torch.randn(2, 4)] * 3),
                         model=[model], num_microbatches=3, seq_length=4, micro_batch_size=2)
        assert len(losses) == 3 and model.weight.grad is not None
        assert not tracker._waiting  # every forward got its backward
        trained = len(ctl.calls)

        def eval_step_func(data, model):
            out = model(next(data)).sum()
            return out, lambda o: (o, {"loss": o.detach()})

        with plan_hooks(ex):  # the schedule fetched inside the hooks is wrapped
            wrapped = schedules.get_forward_backward_func()
            assert wrapped.__wrapped__ is run
            wrapped(forward_step_func=eval_step_func, data_iterator=iter([torch.randn(2, 4)] * 5), model=[model],
                    num_microbatches=5, seq_length=4, micro_batch_size=2, forward_only=True)
            assert ctl.calls[trained:] == []  # evaluation runs at the clock it finds: no switch
            with pytest.raises(PlanMismatchError, match="covers 3 microbatches per iteration, but the schedule runs 2"):
                wrapped(forward_step_func=forward_step_func, data_iterator=iter([torch.randn(2, 4)] * 2),
                        model=[model], num_microbatches=2, seq_length=4, micro_batch_size=2)
            # megatron-core then trains in combined_1f1b, which calls neither forward_step nor backward_step
            model.config.overlap_moe_expert_parallel_comm = True
            with pytest.raises(UnsupportedScheduleError, match="overlap_moe_expert_parallel_comm"):
                wrapped(forward_step_func=forward_step_func, data_iterator=iter([torch.randn(2, 4)] * 3),
                        model=[model], num_microbatches=3, seq_length=4, micro_batch_size=2)
            model.config.overlap_moe_expert_parallel_comm = False
        assert schedules.get_forward_backward_func() is run  # restored
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    assert seen == [("f", 1410, "attn_0"), ("f", 1200, "norm_0"), ("f", 1200, "norm_0")]  # the refused call ran none
    assert ctl.calls == [1410, 1305, 1200, 1305, 1200, 1305, "reset", "reset"]  # f0 b0 f1 b1 f2 b2, one switch each
    assert [(s.microbatch, s.direction) for s in ex.switches] == [
        (0, "fwd"), (0, "bwd"), (1, "fwd"), (1, "bwd"), (2, "fwd"), (2, "bwd")]


def test_a_forward_step_of_another_microbatch_count_is_refused_before_any_switch():
    """A loop that fetched the schedule before the hooks bypasses its wrapper; its forward steps still
    carry the call's microbatch count, and a plan for another count would run another schedule's clocks."""
    ctl = FakeController()
    fake = _fake_schedules([])
    with plan_hooks(PlanExecutor(_plan(num_microbatches=4), ctl, stage=0), fake):
        with pytest.raises(PlanMismatchError, match="covers 4 microbatches per iteration, but the schedule runs 2"):
            fake.forward_step("func", None, None, 2, None, [], None, current_microbatch=0)
    assert ctl.calls == ["reset"]


def test_a_schedule_call_for_another_pipeline_is_refused_before_it_runs():
    calls: list = []
    fake = SimpleNamespace(forward_step=lambda *a, **kw: None, backward_step=lambda *a, **kw: None,
                           forward_backward_pipelining_without_interleaving=lambda **kw: calls.append(kw))
    group = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: 4))
    with plan_hooks(PlanExecutor(_plan(), FakeController(), stage=0), fake):
        with pytest.raises(PlanMismatchError, match="covers 2 pipeline stages, but the schedule runs 4"):
            fake.forward_backward_pipelining_without_interleaving(num_microbatches=4, p2p_communicator=group)
        fake.forward_backward_pipelining_without_interleaving(num_microbatches=7, forward_only=True)  # evaluation
    assert [kw["num_microbatches"] for kw in calls] == [7]


def test_a_rank_whose_executor_follows_another_stage_is_refused_before_the_schedule_runs():
    """The executor's stage was never compared with the rank's own: stage 1 would run stage 0's clocks."""
    calls: list = []
    fake = SimpleNamespace(forward_step=lambda *a, **kw: None, backward_step=lambda *a, **kw: None,
                           forward_backward_pipelining_without_interleaving=lambda **kw: calls.append(kw))
    second = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: 2, rank=lambda: 1))
    with plan_hooks(PlanExecutor(_plan(), FakeController(), stage=0), fake):
        with pytest.raises(PlanMismatchError, match="this rank is pipeline stage 1, but its PlanExecutor follows "
                                                    "stage 0's instructions; build it with stage=1"):
            fake.forward_backward_pipelining_without_interleaving(num_microbatches=4, p2p_communicator=second)
    with plan_hooks(PlanExecutor(_plan(), FakeController(), stage=1), fake):
        fake.forward_backward_pipelining_without_interleaving(num_microbatches=4, p2p_communicator=second)
    assert len(calls) == 1


def test_a_controller_that_leaves_the_clock_to_the_gpu_takes_only_a_plan_of_one_clock():
    from kareus.profiler.frequency import UnlockedFrequencyConfig, UnlockedFrequencyController

    unlocked = UnlockedFrequencyController(UnlockedFrequencyConfig(), None)
    with pytest.raises(ValueError, match="stage 0 at 3 clocks"):
        PlanExecutor(_plan(), unlocked, stage=0)
    PlanExecutor(_plan(), unlocked, stage=1)  # stage 1 runs at 1005 MHz throughout
