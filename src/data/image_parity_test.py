#!/usr/bin/env python3
"""Reference side of image_parity_test (src/data/image_parity_test.cc): PIL 9 and torchvision 0.14.

    image_parity_test.py make DIR    writes the source images DIR/src/* (PIL's encoders, and a small
                                     PNG writer for the bit depths and color types PIL cannot write)
    image_parity_test.py check DIR   reads DIR/manifest.txt, written by the C++ side, recomputes every
                                     case with PIL / torchvision and compares

Manifest lines (paths relative to DIR; raw files are uint8 HWC or float32 CHW, C order):

    decode SRC MODE H W C OUT.raw             Image.open(SRC).convert(MODE), keep: as opened
    u8 INPUT.png H W C OUT.raw OP ARGS...      a uint8 transform of INPUT (PNG, lossless)
    f32 INPUT.png C H W OUT.raw OP ARGS...     a float transform (ToTensor, Normalize)

check prints one line per operation kind with the largest and mean absolute difference, then
"RESULT ok N" or "RESULT fail N" and exits 1 on failure. Exits 3 when PIL or torchvision is missing.
"""
import struct
import sys
import zlib
from collections import defaultdict
from pathlib import Path

try:
    import numpy as np
    import torch
    import torchvision
    import torchvision.transforms as T
    import torchvision.transforms.functional as F
    from PIL import Image
except Exception as e:  # noqa: BLE001 - any import failure means "no reference available"
    print(f"cannot import PIL/torchvision: {e}", file=sys.stderr)
    sys.exit(3)

# Largest absolute difference allowed, in levels (uint8) or in value (float), per operation.
TOLERANCE = {"decode_png": 0, "decode_jpeg": 1, "resize": 0, "center_crop": 0, "random_crop": 0,
             "to_tensor_normalise": 0.0, "compose": 0.0}


def write_png(path, array, color_type, bit_depth, interlace=False, palette=None, trns=None):
    """A minimal PNG writer (filter 0, no interlace) for layouts PIL cannot save."""
    h, w = array.shape[:2]
    rows = []
    for y in range(h):
        row = array[y]
        if bit_depth == 16:
            raw = row.astype(">u2").tobytes()
        elif bit_depth == 8:
            raw = row.astype(np.uint8).tobytes()
        else:  # packed gray or palette indices
            per = 8 // bit_depth
            vals = row.reshape(-1).astype(np.uint8)
            out = bytearray()
            for i in range(0, len(vals), per):
                b = 0
                for j in range(per):
                    v = int(vals[i + j]) if i + j < len(vals) else 0
                    b |= v << (8 - bit_depth * (j + 1))
                out.append(b)
            raw = bytes(out)
        rows.append(b"\x00" + raw)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0))
    if palette is not None:
        data += chunk(b"PLTE", bytes(palette))
    if trns is not None:
        data += chunk(b"tRNS", bytes(trns))
    data += chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b"")
    Path(path).write_bytes(data)


def photo_like(h, w, seed):
    """Smooth shading, hard edges and noise: what resampling sees in real photos."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(x / (7 + c) + y / (11 + 2 * c)) for c in range(3)], axis=-1)
    img[(x // 13 + y // 17) % 2 == 0] *= 0.6
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def make(d):
    src = Path(d) / "src"
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    photo = photo_like(97, 131, 2)
    Image.fromarray(photo).save(src / "pil_rgb.png")
    Image.fromarray(photo[:, :, 1]).save(src / "pil_gray.png")
    Image.fromarray(np.dstack([photo, rng.integers(0, 256, photo.shape[:2], dtype=np.uint8)])).save(src / "pil_rgba.png")
    Image.fromarray(photo).convert("LA").save(src / "pil_la.png")
    Image.fromarray(photo).quantize(50).save(src / "pil_palette.png")
    pal = Image.fromarray(photo).quantize(16)
    pal.info["transparency"] = 3
    pal.save(src / "pil_palette_trns.png", transparency=3)
    for q in (75, 95):
        Image.fromarray(photo).save(src / f"pil_rgb_q{q}.jpg", quality=q)
        Image.fromarray(photo[:, :, 0]).save(src / f"pil_gray_q{q}.jpg", quality=q)
    Image.fromarray(photo).save(src / "pil_rgb_444.jpg", quality=90, subsampling=0)
    Image.fromarray(photo).save(src / "pil_rgb_progressive.jpg", quality=85, progressive=True)
    Image.fromarray(photo[:45, :77]).save(src / "pil_odd_size.jpg", quality=80)
    wide16 = rng.integers(0, 65536, (19, 23, 3), dtype=np.uint32)
    write_png(src / "raw_rgb16.png", wide16, color_type=2, bit_depth=16)
    write_png(src / "raw_rgba16.png", rng.integers(0, 65536, (19, 23, 4), dtype=np.uint32), color_type=6, bit_depth=16)
    write_png(src / "raw_gray16.png", rng.integers(0, 65536, (19, 23), dtype=np.uint32), color_type=0, bit_depth=16)
    write_png(src / "raw_la16.png", rng.integers(0, 65536, (19, 23, 2), dtype=np.uint32), color_type=4, bit_depth=16)
    for bits in (1, 2, 4):
        write_png(src / f"raw_gray{bits}.png", rng.integers(0, 1 << bits, (13, 21)), color_type=0, bit_depth=bits)
        palette = rng.integers(0, 256, 3 * (1 << bits), dtype=np.uint8)
        write_png(src / f"raw_palette{bits}.png", rng.integers(0, 1 << bits, (13, 21)), color_type=3, bit_depth=bits,
                  palette=palette)


def load_raw(path, shape, dtype):
    return np.fromfile(path, dtype=dtype).reshape(shape)


def reference_decode(path, mode):
    im = Image.open(path)
    if mode == "keep":
        if im.mode == "RGBA" and path.read_bytes()[25] == 4:
            # PIL opens 16-bit gray + alpha as RGBA (R = G = B); chorus keeps it gray + alpha.
            return np.array(im)[..., [0, 3]]
        if im.mode == "P":
            im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        elif im.mode == "1":
            im = im.convert("L")
    elif im.mode == "I" and path.suffix == ".png":
        # 16-bit gray: PIL's convert("L") clips the 16-bit values at 255; chorus keeps the high byte
        # (docs/image-data.md), as PIL does for 16-bit RGB.
        return (np.array(im) >> 8).astype(np.uint8)[..., None].repeat(3 if mode == "rgb" else 1, axis=-1)
    else:
        im = im.convert({"rgb": "RGB", "gray": "L"}[mode])
    if im.mode == "I":
        return (np.array(im) >> 8).astype(np.uint8)[..., None]
    a = np.array(im)
    return a[..., None] if a.ndim == 2 else a


def reference_u8(img, op, args):
    if op == "resize":  # resize H W (H = -1: Resize(W), the shorter side)
        h, w = int(args[0]), int(args[1])
        t = T.Resize(w if h < 0 else (h, w), interpolation=T.InterpolationMode.BILINEAR)
        return t(img)
    if op == "center_crop":
        return T.CenterCrop((int(args[0]), int(args[1])))(img)
    if op == "random_crop":  # H W pad_l pad_t pad_r pad_b pad_if_needed fill top left flip
        h, w, pl, pt, pr, pb, need, fill, top, left, flip = (int(a) for a in args)
        crop = T.RandomCrop((h, w), padding=[pl, pt, pr, pb] if (pl or pt or pr or pb) else None,
                            pad_if_needed=bool(need), fill=fill)
        original = T.RandomCrop.get_params
        T.RandomCrop.get_params = staticmethod(lambda _img, _size: (top, left, h, w))
        try:
            out = crop(img)
        finally:
            T.RandomCrop.get_params = original
        return F.hflip(out) if flip else out
    raise ValueError(f"unknown op {op}")


def reference_f32(img, op, args):
    c = len(img.getbands())
    if op == "to_tensor_normalise":
        mean = [float(a) for a in args[:c]]
        std = [float(a) for a in args[c:2 * c]]
        return T.Normalize(mean, std)(T.ToTensor()(img))
    if op == "compose":  # resize_shorter crop_h crop_w mean... std...
        s, ch, cw = int(args[0]), int(args[1]), int(args[2])
        mean = [float(a) for a in args[3:3 + c]]
        std = [float(a) for a in args[3 + c:3 + 2 * c]]
        return T.Compose([T.Resize(s), T.CenterCrop((ch, cw)), T.ToTensor(), T.Normalize(mean, std)])(img)
    raise ValueError(f"unknown op {op}")


def as_hwc(pil_img):
    a = np.array(pil_img)
    return a[..., None] if a.ndim == 2 else a


def check(d):
    d = Path(d)
    stats = defaultdict(lambda: [0, 0.0, 0.0, 0])  # cases, max diff, sum of mean diffs, failures
    failed = 0
    total = 0
    for line in (d / "manifest.txt").read_text().splitlines():
        f = line.split()
        kind = f[0]
        if kind == "decode":
            src, mode, h, w, c, out = f[1], f[2], int(f[3]), int(f[4]), int(f[5]), f[6]
            ours = load_raw(d / out, (h, w, c), np.uint8).astype(np.int32)
            ref = reference_decode(d / src, mode).astype(np.int32)
            op = "decode_jpeg" if src.endswith(".jpg") else "decode_png"
        else:
            inp, a, b, c3, out, op, args = f[1], int(f[2]), int(f[3]), int(f[4]), f[5], f[6], f[7:]
            img = Image.open(d / inp)
            img.load()
            if kind == "u8":
                ours = load_raw(d / out, (a, b, c3), np.uint8).astype(np.int32)
                ref = as_hwc(reference_u8(img, op, args)).astype(np.int32)
            else:
                ours = load_raw(d / out, (a, b, c3), np.float32)
                ref = reference_f32(img, op, args).numpy()
        total += 1
        s = stats[op]
        s[0] += 1
        if ours.shape != ref.shape:
            print(f"FAIL {line}: shape {ours.shape}, reference {ref.shape}")
            s[3] += 1
            failed += 1
            continue
        diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
        mx = float(diff.max()) if diff.size else 0.0
        s[1] = max(s[1], mx)
        s[2] += float(diff.mean()) if diff.size else 0.0
        if mx > TOLERANCE[op]:
            print(f"FAIL {line}: max abs diff {mx} > {TOLERANCE[op]} (mean {diff.mean():.4f})")
            s[3] += 1
            failed += 1
    for op, (n, mx, mean_sum, fails) in sorted(stats.items()):
        print(f"{op}: {n} cases, max abs diff {mx:g}, mean abs diff {mean_sum / n:.6f}, "
              f"tolerance {TOLERANCE[op]}, failures {fails}")
    print(f"torchvision {torchvision.__version__}, torch {torch.__version__}")
    print(f"RESULT {'fail' if failed else 'ok'} {total}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    (make if sys.argv[1] == "make" else check)(sys.argv[2])
