"""Pipeline parallelism for nanotrain's functional models, by hand: see README.md beside this file."""
from nanotrain.pipeline.build import Pipeline, build_pipeline
from nanotrain.pipeline.comm_plan import plan
from nanotrain.pipeline.executor import run_step
from nanotrain.pipeline.layered import Head, Layer, LayeredModel, StageSpec, partition, reference_loss
from nanotrain.pipeline.memory import ActivationMeter
from nanotrain.pipeline.schedule import (SCHEDULES, Action, Schedule, ScheduleError, build_schedule, gpipe,
                                         interleaved_1f1b, one_f_one_b, zb_h1)
from nanotrain.pipeline.timeline import bubble_fraction, format_grid, timeline
from nanotrain.pipeline.train import finish_grads, train_step
from nanotrain.pipeline.validate import validate

__all__ = [
    "Action", "ActivationMeter", "Head", "Layer", "LayeredModel", "Pipeline",
    "SCHEDULES", "Schedule", "ScheduleError", "StageSpec", "bubble_fraction", "build_pipeline", "build_schedule",
    "finish_grads", "format_grid", "gpipe", "interleaved_1f1b",
    "one_f_one_b", "partition", "plan", "reference_loss", "run_step", "timeline",
    "train_step", "validate", "zb_h1",
]
