"""Audio heard while it is spoken, its building blocks: the clip resampler, the log-mel stream and
the audio encoder window by window each equal the whole clip's result bit for bit (and transformers'
feature extractor and audio tower), however the clip is cut."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oracle import audio_features, load_reference_model
from voxpipe.audio import ClipResampler, resample_clip
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.thinker.log_mel import MIN_COLUMNS, LogMelStream, scale
from voxpipe.services.thinker.model import AudioEncoder, audio_output_length, chunk_pad
from voxpipe.services.thinker.prompt import FeatureExtractor
from voxpipe.services.thinker.streamed import StreamedClip


def noise(samples: int, seed: int = 0, level: float = 0.1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * level).astype(np.float32)


def pieces(x: np.ndarray, step: int) -> list[np.ndarray]:
    return [x[i:i + step] for i in range(0, len(x), step)]


def streamed_raw(fe: FeatureExtractor, x: np.ndarray, step: int) -> torch.Tensor:
    s = LogMelStream(fe.fe.mel_filters)
    return torch.cat([s.push(p) for p in pieces(x, step)] + [s.finish()], dim=1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small tensor ops on a shared 2-core machine: torch's thread pool costs ~10 ms per op there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def features(tiny_model_dir) -> FeatureExtractor:
    return FeatureExtractor.for_model(tiny_model_dir)


@pytest.fixture(scope="module")
def towers(tiny_model_dir) -> tuple[AudioEncoder, torch.nn.Module]:
    """Ours with the checkpoint's weights, and transformers' audio tower."""
    ref = load_reference_model(tiny_model_dir)
    theirs = dict(ref.named_modules())["thinker.model.audio_tower"]
    ours = AudioEncoder(OmniConfig.load(tiny_model_dir).thinker.audio)
    ours.load_state_dict(theirs.state_dict(), strict=False)
    return ours.eval(), theirs


@pytest.mark.parametrize("src,dst", [(24000, 16000), (8000, 16000), (16000, 16000)])
def test_clip_resampler_pieces_equal_the_whole_clip(src, dst):
    for n in (1, 5, 2400, 3 * src + 11) if src == 24000 else (5, 2400, src + 11):
        x = noise(n, seed=n)
        whole = resample_clip(x, src, dst)
        assert len(whole) == round(n * dst / src)
        for step in (480, 4801) if n > 3000 else (1, 3, 480):
            r = ClipResampler(src, dst)
            got = np.concatenate([r.push(p) for p in pieces(x, step)] + [r.finish()])
            assert np.array_equal(got, whole), (n, step)


def test_clip_resampler_is_band_limited():
    for src in (24000, 44100):
        t = np.arange(src) / src
        for hz in (440, 4000):
            y = resample_clip(np.sin(2 * np.pi * hz * t).astype(np.float32), src, 16000)
            want = np.sin(2 * np.pi * hz * np.arange(16000) / 16000)
            assert np.abs(y[100:-100] - want[100:-100]).max() < 1e-4, (src, hz)
    t = np.arange(24000) / 24000
    alias = resample_clip(np.sin(2 * np.pi * 10000 * t).astype(np.float32), 24000, 16000)
    assert np.abs(alias[100:-100]).max() < 1e-3          # above the 8 kHz Nyquist: removed
    with pytest.raises(ValueError):
        ClipResampler(0, 16000)
    r = ClipResampler(24000, 16000)
    r.finish()
    with pytest.raises(ValueError):
        r.push(np.zeros(3, np.float32))


# clips: one frame, under MIN_COLUMNS frames, a few seconds, past one encoder window
@pytest.mark.parametrize("samples", [201, 1000, 7013, 16000 * 9 + 77])
def test_log_mel_stream_equals_the_feature_extractor(features, samples):
    x = noise(samples, seed=samples)
    whole = features(x)
    assert torch.equal(whole, audio_features(x))           # ours is transformers' extractor
    for step in (7, 160, 481, 4000, samples) if samples < 20000 else (481, 4000, samples):
        got = scale(streamed_raw(features, x, step))
        assert got.shape == whole.shape and torch.equal(got, whole), step


def test_log_mel_stream_frames_are_final_early_and_short_clips_fail(features):
    x = noise(32000)
    s = LogMelStream(features.fe.mel_filters)
    assert s.push(x[:24000]).shape[1] == (24000 - 200) // 160 + 1     # all but the frames reading past 24000
    s = LogMelStream(features.fe.mel_filters)
    assert s.push(x[:8000]).shape[1] == 0               # under MIN_COLUMNS frames: the clip may end so short
    assert s.push(x[8000:16000]).shape[1] == (16000 - 200) // 160 + 1 > MIN_COLUMNS
    s = LogMelStream(features.fe.mel_filters)
    s.push(x[:200])
    with pytest.raises(ValueError, match="too short"):
        s.finish()
    with pytest.raises(ValueError):
        s.push(x[:10])


@pytest.mark.parametrize("seconds", [0.5, 3.0, 8.0, 17.3])
def test_encoder_per_window_equals_whole_clip_and_transformers(towers, seconds):
    ours, theirs = towers
    f = audio_features(noise(int(16000 * seconds), seed=int(seconds * 10)))
    frames = f.shape[1]
    with torch.no_grad():
        whole = ours(f)
        ref = theirs(f, feature_lens=torch.tensor([frames])).last_hidden_state
        pad = chunk_pad([frames], ours.cfg.n_window)
        w = ours.cfg.n_window_infer
        per_window = torch.cat([ours(f[:, s:s + w], pad) for s in range(0, frames, w)])
    assert whole.shape[0] == audio_output_length(frames, ours.cfg.n_window)
    assert torch.equal(whole, ref)
    assert torch.equal(whole, per_window)


def clip_with_levels(levels: list[float], seconds_each: float) -> np.ndarray:
    n = int(16000 * seconds_each)
    return np.concatenate([noise(n, seed=i, level=lv) for i, lv in enumerate(levels)])


@pytest.mark.parametrize("levels,kept", [
    ([0.3, 0.01, 0.05], 2),     # loudest first: the windows heard early keep their encoding
    ([1e-5, 1e-5, 0.5], 0),     # silence, then loud: the clamp rises, every window is encoded again
])
def test_streamed_clip_equals_the_whole_clip(features, towers, levels, kept):
    """Windows encoded while the clip arrives (with the maximum so far), the rest at the end: the
    clip's rows equal the whole clip's features encoded at once; windows whose clamp changed are
    encoded again."""
    ours, _ = towers
    x = clip_with_levels(levels, 7.0)              # 21 s: two complete windows and a tail
    whole_features = features(x)
    stream = LogMelStream(features.fe.mel_filters)
    clip = StreamedClip.for_tower(ours)
    encoded = 0
    with torch.no_grad():
        for p in pieces(x, 16000):                 # a second at a time
            clip.append(stream.push(p))
            encoded += clip.encode_windows(ours, torch.float32, torch.device("cpu")).shape[0]
        clip.append(stream.finish())
        assert encoded == 2 * clip.window_tokens
        pad = chunk_pad([whole_features.shape[1]], ours.cfg.n_window)
        assert clip.finish(ours, pad, torch.float32, torch.device("cpu")) == kept
        whole = ours(whole_features, pad)
    assert torch.equal(clip.features, whole_features)
    assert torch.equal(clip.rows, whole)
