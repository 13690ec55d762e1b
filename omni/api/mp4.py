"""Frames to an MP4 file and back, with PyAV (its wheels carry FFmpeg and x264: no system encoder).

Lossless: H.264 of the RGB frames themselves (libx264rgb, qp 0), so a decoded frame is the uint8 frame the
model made, bit for bit. Players that only take 4:2:0 YUV (browsers) may refuse it; that is the price of
handing over exactly what the pipeline made.
"""

from __future__ import annotations

import io

import numpy as np

CONTENT_TYPE = "video/mp4"


def encode(frames: np.ndarray, fps: int) -> bytes:
    """uint8 [frames, height, width, 3] -> MP4 bytes at `fps` frames a second."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as box:
        stream = box.add_stream("libx264rgb", rate=fps)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "rgb24"
        stream.options = {"qp": "0", "preset": "ultrafast"}    # qp 0: lossless; the preset only trades size
        for frame in frames:
            box.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        box.mux(stream.encode())
    return buf.getvalue()


def decode(data: bytes) -> tuple[np.ndarray, float]:
    """MP4 bytes -> (uint8 [frames, height, width, 3], frames a second)."""
    import av

    with av.open(io.BytesIO(data)) as box:
        stream = box.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in box.decode(stream)])
        return frames, float(stream.average_rate)
