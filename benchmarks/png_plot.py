"""A size-against-quality scatter plot written as a PNG with numpy and zlib (no plotting library).

The quality table (bench_quality.py) wants one picture; matplotlib would be a 40 MB dependency (with Pillow,
fontTools, kiwisolver...) for it, so this draws points, error bars, lines, axes with ticks and labels in a 3x5
pixel font, scaled up. Text is upper-case (the font has digits, A-Z and a few signs).
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001010010",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", "-": "000000111000000", "_": "000000000000111", "(": "001010010010001",
    ")": "100010010010100", "%": "101001010100101", "/": "001001010100100", " ": "000000000000000",
    "+": "000010111010000", "=": "000111000111000", ":": "000010000010000", ",": "000000000010100",
}
SCALE = 2                       # font pixels per glyph pixel
PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]


@dataclass
class Series:
    name: str
    points: list[tuple[float, float, float, str]] = field(default_factory=list)   # (x, y, y error, label)
    line: bool = False


class Canvas:
    def __init__(self, width: int, height: int):
        self.px = np.full((height, width, 3), 255, np.uint8)

    def dot(self, x: int, y: int, color, r: int = 3) -> None:
        h, w = self.px.shape[:2]
        ys, xs = np.ogrid[:h, :w]
        self.px[(xs - x) ** 2 + (ys - y) ** 2 <= r * r] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0, 1, n):
            x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
            self.px[max(0, y - width // 2):y + width // 2 + 1, max(0, x - width // 2):x + width // 2 + 1] = color

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), vertical: bool = False) -> None:
        for i, ch in enumerate(s.upper()):
            bits = _GLYPHS.get(ch, _GLYPHS[" "])
            for r in range(5):
                for c in range(3):
                    if bits[r * 3 + c] == "1":
                        if vertical:     # read bottom to top
                            gx, gy = x + r * SCALE, y - (i * 4 + c) * SCALE
                        else:
                            gx, gy = x + (i * 4 + c) * SCALE, y + r * SCALE
                        self.px[gy:gy + SCALE, gx:gx + SCALE] = color

    def png(self, path: Path) -> None:
        h, w = self.px.shape[:2]
        raw = b"".join(b"\x00" + self.px[r].tobytes() for r in range(h))
        chunk = lambda tag, data: (struct.pack(">I", len(data)) + tag + data
                                   + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))
        Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                               + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    step = 10 ** math.floor(math.log10((hi - lo) / 4 or 1))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= 6)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0e}".replace("E-0", "E-").replace("e-0", "E-") if v < 0.01 else f"{v:g}"


def scatter_png(path: Path, series: list[Series], title: str, xlabel: str, ylabel: str, logy: bool = True,
                width: int = 1100, height: int = 700) -> Path:
    """Plot the series (x linear, y log by default) with labelled points and a legend; write `path`."""
    pts = [p for s in series for p in s.points if p[1] > 0 or not logy]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x_lo, x_hi = min(xs), max(xs)
    pad = (x_hi - x_lo) * 0.05 or 1
    x_lo, x_hi = x_lo - pad, x_hi + pad
    y_lo, y_hi = min(ys), max(p[1] + p[2] for p in pts)
    if logy:
        y_lo, y_hi = 10 ** math.floor(math.log10(y_lo)), 10 ** math.ceil(math.log10(y_hi))
    left, right, top, bottom = 90, 220, 50, 70
    W, H = width - left - right, height - top - bottom
    fx = lambda x: left + (x - x_lo) / (x_hi - x_lo) * W
    fy = (lambda y: top + H - (math.log10(max(y, y_lo)) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo)) * H) \
        if logy else (lambda y: top + H - (y - y_lo) / (y_hi - y_lo) * H)
    c = Canvas(width, height)
    c.text(left, 15, title)
    c.line(left, top + H, left + W, top + H, (0, 0, 0))
    c.line(left, top, left, top + H, (0, 0, 0))
    for t in _ticks(x_lo, x_hi, False):
        c.line(fx(t), top + H, fx(t), top + H + 5, (0, 0, 0))
        c.line(fx(t), top, fx(t), top + H, (230, 230, 230))
        c.text(int(fx(t)) - 8, top + H + 10, _fmt(t))
    for t in _ticks(y_lo, y_hi, logy):
        if y_lo <= t <= y_hi:
            c.line(left - 5, fy(t), left, fy(t), (0, 0, 0))
            c.line(left, fy(t), left + W, fy(t), (230, 230, 230))
            c.text(left - 60, int(fy(t)) - 5, _fmt(t))
    c.text(left + W // 2 - 60, height - 30, xlabel)
    c.text(20, top + H // 2 + 60, ylabel, vertical=True)
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        shown = sorted((p for p in s.points if p[1] > 0 or not logy), key=lambda p: p[0])
        if s.line:
            for a, b in zip(shown, shown[1:]):
                c.line(fx(a[0]), fy(a[1]), fx(b[0]), fy(b[1]), color)
        for x, y, err, label in shown:
            c.line(fx(x), fy(max(y - err, y_lo)), fx(x), fy(y + err), color)
            c.dot(int(fx(x)), int(fy(y)), color)
            c.text(int(fx(x)) + 6, int(fy(y)) - 12, label, color)
        c.dot(left + W + 20, top + 10 + 20 * i, color)
        c.text(left + W + 30, top + 5 + 20 * i, s.name, color)
    c.png(path)
    return Path(path)
