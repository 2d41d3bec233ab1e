"""Graph capture and replay: descriptors and dispatch, and a runner-free graph manager."""

from mrv2.runner.graphs.descriptor import (BatchDescriptor, GraphConfig, GraphDispatcher, GraphMode,
                                           default_capture_sizes, pad_query_start_loc, padding)
from mrv2.runner.graphs.manager import CaptureHooks, GraphInputs, GraphManager, Recorder, Recording, WholeForward

__all__ = ["BatchDescriptor", "CaptureHooks", "GraphConfig", "GraphDispatcher", "GraphInputs", "GraphManager",
           "Recorder", "Recording", "WholeForward",
           "GraphMode", "default_capture_sizes", "pad_query_start_loc", "padding"]
