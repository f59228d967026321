// JPEG and PNG decoding and encoding (docs/image-data.md).
//
// libpng reports errors by longjmp. Every libpng call that can fail runs inside one of the small
// functions below that call setjmp first and hold no C++ object with a destructor, so a longjmp
// skips nothing; they return false with the message in PngContext::error, and the caller (plain
// C++ again, owning the libpng structs through a guard) throws. Warnings are dropped: the library
// writes nothing to stderr.
#include "chorus/data/image.h"

#include <png.h>
#include <turbojpeg.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace chorus::data {
namespace {

constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

std::string first_bytes(const uint8_t* b, size_t n) {
  std::string out;
  char hex[4];
  for (size_t i = 0; i < n && i < 8; ++i) {
    std::snprintf(hex, sizeof(hex), "%s%02x", i == 0 ? "" : " ", b[i]);
    out += hex;
  }
  return out;
}

// Another image format we can name, so that the error says what the file is.
const char* other_format(const uint8_t* b, size_t n) {
  if (n >= 4 && std::memcmp(b, "GIF8", 4) == 0) return "GIF";
  if (n >= 2 && b[0] == 'B' && b[1] == 'M') return "BMP";
  if (n >= 12 && std::memcmp(b, "RIFF", 4) == 0 && std::memcmp(b + 8, "WEBP", 4) == 0) return "WebP";
  if (n >= 4 && (std::memcmp(b, "II*\0", 4) == 0 || std::memcmp(b, "MM\0*", 4) == 0)) return "TIFF";
  return nullptr;
}

void check_size(int64_t width, int64_t height, const std::string& name, const char* format) {
  if (width <= 0 || height <= 0 || width > kMaxImagePixels / height) {
    throw ImageError(name + ": " + format + " header claims " + std::to_string(width) + "x" + std::to_string(height) +
                     " pixels (at most " + std::to_string(kMaxImagePixels) + "); damaged or not a real image");
  }
}

// PIL's convert("L") from RGB: ITU-R 601-2 luma in 16-bit fixed point, rounded.
uint8_t luma(const uint8_t* rgb) {
  return static_cast<uint8_t>((rgb[0] * 19595u + rgb[1] * 38470u + rgb[2] * 7471u + 0x8000u) >> 16);
}

// From the decoded channels (1 gray, 2 gray + alpha, 3 RGB, 4 RGBA) to what `mode` asks for, as
// PIL's convert does: alpha dropped, gray copied to R, G and B, RGB to luma.
Image convert(Image in, ImageMode mode) {
  const int64_t want = mode == ImageMode::kGray ? 1 : mode == ImageMode::kRGB ? 3 : in.channels;
  if (want == in.channels) return in;
  Image out(in.height, in.width, want);
  const size_t n = static_cast<size_t>(in.height * in.width);
  const uint8_t* src = in.pixels.data();
  uint8_t* dst = out.pixels.data();
  const size_t c = static_cast<size_t>(in.channels);
  for (size_t i = 0; i < n; ++i, src += c) {
    if (want == 1) {
      dst[i] = c >= 3 ? luma(src) : src[0];
    } else if (c >= 3) {
      std::memcpy(dst + 3 * i, src, 3);
    } else {
      dst[3 * i] = dst[3 * i + 1] = dst[3 * i + 2] = src[0];
    }
  }
  return out;
}

// ---- PNG ----

struct PngContext {
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t pos = 0;
  std::vector<uint8_t>* out = nullptr;  // when writing
  char error[256] = {0};
};

void png_on_error(png_structp png, png_const_charp message) {
  auto* ctx = static_cast<PngContext*>(png_get_error_ptr(png));
  std::snprintf(ctx->error, sizeof(ctx->error), "%s", message);
  png_longjmp(png, 1);
}

void png_on_warning(png_structp, png_const_charp) {}

void png_read_bytes(png_structp png, png_bytep out, png_size_t n) {
  auto* ctx = static_cast<PngContext*>(png_get_io_ptr(png));
  if (ctx->size - ctx->pos < n) png_error(png, "the file ends early (truncated PNG)");
  std::memcpy(out, ctx->data + ctx->pos, n);
  ctx->pos += n;
}

void png_write_bytes(png_structp png, png_bytep in, png_size_t n) {
  auto* ctx = static_cast<PngContext*>(png_get_io_ptr(png));
  ctx->out->insert(ctx->out->end(), in, in + n);
}

void png_flush(png_structp) {}

struct PngInfo {
  png_uint_32 width = 0;
  png_uint_32 height = 0;
  int channels = 0;
};

// Reads the header and sets the transforms that leave 8-bit gray, gray + alpha, RGB or RGBA.
bool png_read_header(png_structp png, png_infop info, PngInfo* out) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_user_limits(png, 1u << 24, 1u << 24);
  png_read_info(png, info);
  const int color_type = png_get_color_type(png, info);
  const int bit_depth = png_get_bit_depth(png, info);
  if (bit_depth == 16) png_set_strip_16(png);  // the high byte, as PIL's RGB;16B unpacking
  if (color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color_type == PNG_COLOR_TYPE_GRAY && bit_depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  out->width = png_get_image_width(png, info);
  out->height = png_get_image_height(png, info);
  out->channels = png_get_channels(png, info);
  return true;
}

bool png_read_rows(png_structp png, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_image(png, rows);
  return true;
}

struct PngReadGuard {
  png_structp png = nullptr;
  png_infop info = nullptr;
  ~PngReadGuard() { png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr); }
};

Image decode_png(const uint8_t* data, size_t n, const std::string& name) {
  PngContext ctx;
  ctx.data = data;
  ctx.size = n;
  PngReadGuard g;
  g.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &ctx, png_on_error, png_on_warning);
  if (g.png != nullptr) g.info = png_create_info_struct(g.png);
  if (g.info == nullptr) throw ImageError(name + ": cannot decode PNG: out of memory");
  png_set_read_fn(g.png, &ctx, png_read_bytes);

  PngInfo info;
  if (!png_read_header(g.png, g.info, &info)) throw ImageError(name + ": corrupt PNG header: " + ctx.error);
  check_size(info.width, info.height, name, "PNG");
  if (info.channels < 1 || info.channels > 4) {
    throw ImageError(name + ": PNG decodes to " + std::to_string(info.channels) + " channels; expected 1 to 4");
  }
  Image image(info.height, info.width, info.channels);
  std::vector<png_bytep> rows(info.height);
  for (png_uint_32 y = 0; y < info.height; ++y) rows[y] = image.row(y);
  if (!png_read_rows(g.png, rows.data())) throw ImageError(name + ": corrupt PNG data: " + ctx.error);
  return image;
}

bool png_write_all(png_structp png, png_infop info, const PngInfo& header, int level, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  static const int kColorTypes[5] = {0, PNG_COLOR_TYPE_GRAY, PNG_COLOR_TYPE_GRAY_ALPHA, PNG_COLOR_TYPE_RGB,
                                     PNG_COLOR_TYPE_RGB_ALPHA};
  png_set_compression_level(png, level);
  png_set_IHDR(png, info, header.width, header.height, 8, kColorTypes[header.channels], PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  return true;
}

struct PngWriteGuard {
  png_structp png = nullptr;
  png_infop info = nullptr;
  ~PngWriteGuard() { png_destroy_write_struct(&png, info != nullptr ? &info : nullptr); }
};

// ---- JPEG ----

struct TjHandle {
  tjhandle h;
  explicit TjHandle(tjhandle handle) : h(handle) {}
  ~TjHandle() {
    if (h != nullptr) tjDestroy(h);
  }
  TjHandle(const TjHandle&) = delete;
  TjHandle& operator=(const TjHandle&) = delete;
};

Image decode_jpeg(const uint8_t* data, size_t n, const std::string& name) {
  TjHandle tj(tjInitDecompress());
  if (tj.h == nullptr) throw ImageError(name + ": cannot start the JPEG decoder: " + tjGetErrorStr2(nullptr));
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(tj.h, data, static_cast<unsigned long>(n), &width, &height, &subsamp, &colorspace) != 0) {
    throw ImageError(name + ": corrupt JPEG header: " + tjGetErrorStr2(tj.h));
  }
  check_size(width, height, name, "JPEG");
  if (colorspace == TJCS_CMYK || colorspace == TJCS_YCCK) {
    throw ImageError(name + ": a CMYK JPEG; only grayscale and color (YCbCr/RGB) JPEGs are supported");
  }
  const bool gray = colorspace == TJCS_GRAY;
  Image image(height, width, gray ? 1 : 3);
  // Default flags: accurate integer DCT and fancy upsampling, PIL's libjpeg settings.
  if (tjDecompress2(tj.h, data, static_cast<unsigned long>(n), image.pixels.data(), width, 0, height,
                    gray ? TJPF_GRAY : TJPF_RGB, TJFLAG_STOPONWARNING) != 0) {
    throw ImageError(name + ": corrupt or truncated JPEG: " + tjGetErrorStr2(tj.h));
  }
  return image;
}

}  // namespace

ImageFormat sniff_image_format(const void* bytes, size_t n) {
  const auto* b = static_cast<const uint8_t*>(bytes);
  if (n >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return ImageFormat::kJpeg;
  if (n >= 8 && std::memcmp(b, kPngSignature, 8) == 0) return ImageFormat::kPng;
  return ImageFormat::kUnknown;
}

Image decode_image(const void* bytes, size_t n, ImageMode mode, const std::string& name_for_errors) {
  const auto* b = static_cast<const uint8_t*>(bytes);
  if (n == 0) throw ImageError(name_for_errors + ": empty file, not an image");
  switch (sniff_image_format(bytes, n)) {
    case ImageFormat::kJpeg:
      return convert(decode_jpeg(b, n, name_for_errors), mode);
    case ImageFormat::kPng:
      return convert(decode_png(b, n, name_for_errors), mode);
    case ImageFormat::kUnknown:
      break;
  }
  if (const char* other = other_format(b, n)) {
    throw ImageError(name_for_errors + ": a " + other + " image; only JPEG and PNG are supported");
  }
  throw ImageError(name_for_errors + ": not a JPEG or PNG image (first bytes " + first_bytes(b, n) + ")");
}

Image read_image(const std::string& path, ImageMode mode) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!f) throw ImageError(path + ": cannot open: " + std::strerror(errno));
  std::vector<uint8_t> bytes;
  uint8_t buf[1 << 16];
  for (size_t k; (k = std::fread(buf, 1, sizeof(buf), f.get())) > 0;) bytes.insert(bytes.end(), buf, buf + k);
  if (std::ferror(f.get())) throw ImageError(path + ": cannot read: " + std::strerror(errno));
  return decode_image(bytes.data(), bytes.size(), mode, path);
}

std::vector<uint8_t> encode_png(const Image& image, int compression_level) {
  if (image.channels < 1 || image.channels > 4 || image.height <= 0 || image.width <= 0 ||
      image.pixels.size() != static_cast<size_t>(image.height * image.width * image.channels)) {
    throw ImageError("encode_png: bad image " + std::to_string(image.height) + "x" + std::to_string(image.width) +
                     "x" + std::to_string(image.channels) + " with " + std::to_string(image.pixels.size()) + " bytes");
  }
  if (compression_level < 0 || compression_level > 9) {
    throw ImageError("encode_png: compression_level " + std::to_string(compression_level) + " not in [0, 9]");
  }
  std::vector<uint8_t> out;
  PngContext ctx;
  ctx.out = &out;
  PngWriteGuard g;
  g.png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &ctx, png_on_error, png_on_warning);
  if (g.png != nullptr) g.info = png_create_info_struct(g.png);
  if (g.info == nullptr) throw ImageError("encode_png: out of memory");
  png_set_write_fn(g.png, &ctx, png_write_bytes, png_flush);
  PngInfo header;
  header.width = static_cast<png_uint_32>(image.width);
  header.height = static_cast<png_uint_32>(image.height);
  header.channels = static_cast<int>(image.channels);
  std::vector<png_bytep> rows(static_cast<size_t>(image.height));
  for (int64_t y = 0; y < image.height; ++y) rows[static_cast<size_t>(y)] = const_cast<png_bytep>(image.row(y));
  if (!png_write_all(g.png, g.info, header, compression_level, rows.data())) {
    throw ImageError(std::string("encode_png: ") + ctx.error);
  }
  return out;
}

std::vector<uint8_t> encode_jpeg(const Image& image, int quality) {
  if ((image.channels != 1 && image.channels != 3) || image.height <= 0 || image.width <= 0 ||
      image.pixels.size() != static_cast<size_t>(image.height * image.width * image.channels)) {
    throw ImageError("encode_jpeg: bad image " + std::to_string(image.height) + "x" + std::to_string(image.width) +
                     "x" + std::to_string(image.channels) + " (JPEG takes 1 or 3 channels)");
  }
  if (quality < 1 || quality > 100) throw ImageError("encode_jpeg: quality " + std::to_string(quality) + " not in [1, 100]");
  TjHandle tj(tjInitCompress());
  if (tj.h == nullptr) throw ImageError(std::string("encode_jpeg: ") + tjGetErrorStr2(nullptr));
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const bool gray = image.channels == 1;
  const int rc = tjCompress2(tj.h, image.pixels.data(), static_cast<int>(image.width), 0, static_cast<int>(image.height),
                             gray ? TJPF_GRAY : TJPF_RGB, &buf, &size, gray ? TJSAMP_GRAY : TJSAMP_420, quality, 0);
  std::unique_ptr<unsigned char, void (*)(unsigned char*)> owned(buf, tjFree);
  if (rc != 0) throw ImageError(std::string("encode_jpeg: ") + tjGetErrorStr2(tj.h));
  return std::vector<uint8_t>(buf, buf + size);
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), std::fclose);
  if (!f) throw ImageError(path + ": cannot create: " + std::strerror(errno));
  if (std::fwrite(bytes.data(), 1, bytes.size(), f.get()) != bytes.size() || std::fflush(f.get()) != 0) {
    throw ImageError(path + ": cannot write: " + std::strerror(errno));
  }
}

}  // namespace chorus::data
