"""Camera frames of a LeRobot dataset: mp4 videos (PyAV) or images embedded in the data files (PNG).

Videos are H.264 (libx264) where PyAV's FFmpeg has that encoder, else AV1 (libsvtav1, LeRobot's
own default); either way yuv420p, a key frame every 2 frames as LeRobot writes them (its readers
seek to every frame they load). Reading decodes whatever codec PyAV's FFmpeg decodes (H.264, AV1
through libdav1d, HEVC, ...). An embedded image is the Hugging Face ``Image`` struct
``{bytes, path}``, its bytes a PNG file (lossless).
"""

from __future__ import annotations

import io
import os
from typing import Any

import av
import numpy as np
import pyarrow as pa
from PIL import Image

from robo_post.store.lerobot_format import VIDEO_PATH, FeatureMismatchError, LeRobotError, next_file

PIX_FMT = "yuv420p"
GOP = 2
# H.264's "visually lossless" quality: lower, files grow for little gain, as yuv420p's halved colour
# resolution bounds the fidelity anyway (a 40-frame 64x48 camera-like clip measured 32.6 dB PSNR
# at crf 0, 32.2 dB at 18, 31.0 dB at 30).
CRF = 18
# A frame further than this from the time an episode asks for is missing (LeRobot's tolerance_s).
TOLERANCE_S = 1e-4
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


class VideoDecodeError(LeRobotError):
    """A video file is missing, cannot be decoded, or lacks a frame an episode needs."""


def video_codec() -> str:
    """The encoder exports use: ``libx264`` (H.264) when PyAV has it, else ``libsvtav1`` (AV1)."""
    for codec in ("libx264", "libsvtav1"):
        if codec in av.codecs_available:
            return codec
    raise LeRobotError("PyAV's FFmpeg has neither libx264 nor libsvtav1 to encode videos with: export with "
                       "--images to embed the frames as PNG")


class VideoWriter:
    """One camera's mp4 file, episodes appended back to back: frame n is shown at n / fps seconds."""

    def __init__(self, path: str, codec: str, fps: int, height: int, width: int):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._container = av.open(path, "w")
        self._stream = self._container.add_stream(codec, rate=fps)
        self._stream.width, self._stream.height, self._stream.pix_fmt = width, height, PIX_FMT
        self._stream.options = {"crf": str(CRF), "g": str(GOP)}
        self.fps, self.frames, self.nbytes = fps, 0, 0

    def append(self, frames: np.ndarray) -> tuple[float, float]:
        """Encode ``(T, H, W, 3)`` uint8 frames; their from and to timestamps in the file."""
        start = self.frames
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts = self.frames  # in the stream's time base, 1 / fps
            self._mux(self._stream.encode(frame))
            self.frames += 1
        return start / self.fps, self.frames / self.fps

    def _mux(self, packets: list) -> None:
        for packet in packets:
            self.nbytes += packet.size
            self._container.mux(packet)

    def close(self) -> None:
        """Flush the encoder's delayed frames and finish the file."""
        self._mux(self._stream.encode(None))
        self._container.close()


class VideoReader:
    """One camera's frames, decoded forward through its files: episodes are read in order, so a
    file is decoded once (and again from its start only for an episode earlier in it)."""

    def __init__(self, root: str, template: str, key: str):
        self._root, self._template, self._key = root, template, key
        self._path: str | None = None
        self._container = self._frames = None
        self._time = 0.0  # of the last frame decoded

    def frames(self, chunk: int, file: int, times: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The ``(T, H, W, 3)`` frames at ``times`` (seconds in the file) of ``videos/<key>/chunk/file``."""
        path = os.path.join(self._root, self._template.format(video_key=self._key, chunk_index=chunk, file_index=file))
        if path != self._path or times[0] < self._time - TOLERANCE_S:
            self._open(path)
        out = []
        try:
            for t in times:
                while True:
                    frame = next(self._frames, None)
                    if frame is not None and frame.time is None:  # no timestamp: not one an episode can ask for
                        continue
                    if frame is None or frame.time > t + TOLERANCE_S:
                        ends = "the video ends" if frame is None else f"the next frame is at {frame.time:.6f} s"
                        raise VideoDecodeError(f"{path} has no frame at {t:.6f} s ({ends}): the video is shorter "
                                               "than the episode, or its timestamps disagree with the data")
                    self._time = frame.time
                    if frame.time >= t - TOLERANCE_S:
                        break
                image = frame.to_ndarray(format="rgb24")
                if image.shape != shape:
                    raise FeatureMismatchError(f"{path}: frames of {list(image.shape)}, but feature "
                                               f"{self._key!r} has shape {list(shape)}")
                out.append(image)
        except LeRobotError:
            raise
        except Exception as e:  # noqa: BLE001 (FFmpeg's errors: InvalidDataError, ...)
            raise VideoDecodeError(f"{path} cannot be decoded: {e}") from None
        return np.stack(out)

    def _open(self, path: str) -> None:
        self.close()
        if not os.path.isfile(path):
            raise VideoDecodeError(f"video {path} is missing")
        try:
            self._container = av.open(path)
            stream = self._container.streams.video[0]
            self._frames = self._container.decode(stream)
        except Exception as e:  # noqa: BLE001 (FFmpeg's errors: InvalidDataError, IndexError for no stream, ...)
            self.close()
            raise VideoDecodeError(f"{path} is not a decodable video: {e}") from None
        self._path, self._time = path, 0.0

    def close(self) -> None:
        """Close the open file, if any."""
        if self._container is not None:
            self._container.close()
        self._path, self._container, self._frames = None, None, None


class VideoFiles:
    """One camera's video files being written, the next file past the size limit."""

    def __init__(self, root: str, key: str, codec: str, fps: int, shape: tuple[int, ...], limit_mb: float,
                 chunks_size: int):
        self._root, self._key, self._codec, self._fps, self._shape = root, key, codec, fps, shape
        self._limit, self._chunks_size = limit_mb * 2**20, chunks_size
        self.chunk = self.file = 0
        self._writer: VideoWriter | None = None

    def append(self, frames: np.ndarray) -> dict[str, Any]:
        """Encode one episode's frames; its ``videos/<key>/...`` columns of the episode metadata."""
        if self._writer is not None and self._writer.nbytes >= self._limit:
            self.close()
            self.chunk, self.file = next_file(self.chunk, self.file, self._chunks_size)
        if self._writer is None:
            path = os.path.join(self._root, VIDEO_PATH.format(video_key=self._key, chunk_index=self.chunk,
                                                              file_index=self.file))
            self._writer = VideoWriter(path, self._codec, self._fps, *self._shape[:2])
        start, end = self._writer.append(frames)
        prefix = f"videos/{self._key}/"
        return {prefix + "chunk_index": self.chunk, prefix + "file_index": self.file,
                prefix + "from_timestamp": start, prefix + "to_timestamp": end}

    def close(self) -> None:
        """Finish the file being written."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def video_info(codec: str, fps: int, height: int, width: int) -> dict:
    """The ``info`` LeRobot records in a video feature of ``meta/info.json``."""
    return {"video.height": height, "video.width": width, "video.codec": av.Codec(codec, "w").canonical_name,
            "video.pix_fmt": PIX_FMT, "video.is_depth_map": False, "video.fps": fps, "video.channels": 3,
            "has_audio": False}


def to_images(frames: np.ndarray) -> pa.Array:
    """``(T, H, W, 3)`` uint8 frames as a column of embedded PNG images."""
    encoded = []
    for image in frames:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append({"bytes": buffer.getvalue(), "path": None})
    return pa.array(encoded, IMAGE_TYPE)


def from_images(column: pa.ChunkedArray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """A column of embedded images as ``(T, *shape)`` uint8 RGB frames."""
    if not pa.types.is_struct(column.type) or column.type.get_field_index("bytes") < 0:
        raise FeatureMismatchError(f"{what}: a column of {column.type}, not of embedded images {{bytes, path}}")
    out = []
    for i, data in enumerate(column.combine_chunks().field("bytes").to_pylist()):
        if data is None:
            raise FeatureMismatchError(f"{what}: frame {i} has no embedded image bytes")
        try:
            image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        except Exception as e:  # noqa: BLE001 (PIL raises UnidentifiedImageError, OSError, ...)
            raise FeatureMismatchError(f"{what}: frame {i} is not a readable image: {e}") from None
        if image.shape != shape:
            raise FeatureMismatchError(f"{what}: frame {i} is {list(image.shape)}, its feature says {list(shape)}")
        out.append(image)
    return np.stack(out)
