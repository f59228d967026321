// Fuzz target: the S3 client's readers of the server's XML answers (src/data/s3_internal.h, through
// libexpat): a ListObjectsV2 page and an error document, and the URL decoding of listed keys. A
// malformed answer must raise S3Error, nothing else.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "chorus/data/s3.h"
#include "data/s3_internal.h"

namespace s3 = chorus::data::s3_detail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string xml(reinterpret_cast<const char*>(data), size);
  try {
    const s3::ListPage page = s3::parse_list_page(xml);
    if (page.is_truncated && page.next_continuation_token.empty()) std::abort();
  } catch (const chorus::data::S3Error&) {
  }
  try {
    (void)s3::parse_error_body(xml);
  } catch (const chorus::data::S3Error&) {
  }
  (void)s3::url_decode(xml);
  return 0;
}
