"""onnxruntime sessions sized for a shared CPU host."""

from __future__ import annotations

import os

import onnxruntime as ort


def make_session(path: str | os.PathLike, threads: int = 1) -> ort.InferenceSession:
    # Several stage processes share a few cores: one thread each and no
    # spinning, or they starve each other (see RECIPES.md, "Threads").
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3     # warnings about unused initializers are noise here
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
