// S3's XML answers, read with libexpat (Debian's libexpat1: small, streaming, decodes entities and
// character references, guards against entity expansion attacks), and the URI encoding SigV4 needs.
#include <expat.h>
#include <openssl/evp.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "s3_internal.h"

namespace chorus::data::s3_detail {
namespace {

// Calls leaf(path, text) for every element closed, path being the element names from the root
// joined by '/' ("ListBucketResult/Contents/Key"). Returns "" or expat's error with its line.
std::string walk_xml(const std::string& xml, const std::function<void(const std::string&, const std::string&)>& leaf) {
  struct State {
    std::string path;
    std::vector<std::size_t> starts;  // path length before each open element
    std::string text;
    const std::function<void(const std::string&, const std::string&)>* leaf;
  } state;
  state.leaf = &leaf;
  XML_Parser parser = XML_ParserCreate("UTF-8");
  if (parser == nullptr) return "out of memory creating the XML parser";
  XML_SetUserData(parser, &state);
  XML_SetElementHandler(
      parser,
      [](void* data, const XML_Char* name, const XML_Char**) {
        auto* s = static_cast<State*>(data);
        s->starts.push_back(s->path.size());
        if (!s->path.empty()) s->path += '/';
        s->path += name;
        s->text.clear();
      },
      [](void* data, const XML_Char*) {
        auto* s = static_cast<State*>(data);
        (*s->leaf)(s->path, s->text);
        s->text.clear();
        s->path.resize(s->starts.back());
        s->starts.pop_back();
      });
  XML_SetCharacterDataHandler(parser, [](void* data, const XML_Char* chars, int len) {
    static_cast<State*>(data)->text.append(chars, static_cast<std::size_t>(len));
  });
  std::string error;
  if (XML_Parse(parser, xml.data(), static_cast<int>(xml.size()), /*isFinal=*/1) == XML_STATUS_ERROR) {
    error = std::string(XML_ErrorString(XML_GetErrorCode(parser))) + " at line " +
            std::to_string(XML_GetCurrentLineNumber(parser));
  }
  XML_ParserFree(parser);
  return error;
}

std::string strip_quotes(const std::string& s) {
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') return s.substr(1, s.size() - 2);
  return s;
}

}  // namespace

std::string uri_encode(const std::string& s, bool keep_slash) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size() * 3);
  for (unsigned char c : s) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
        c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::string url_decode(const std::string& s) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out += ' ';
    } else if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::string sha256_hex(const void* data, std::size_t size) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, size, digest, &len, EVP_sha256(), nullptr);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

std::string list_query(const std::string& prefix, int max_keys, const std::string& continuation_token) {
  // Sorted by parameter name: continuation-token, encoding-type, list-type, max-keys, prefix.
  std::string q;
  if (!continuation_token.empty()) q += "continuation-token=" + uri_encode(continuation_token, false) + "&";
  q += "encoding-type=url&list-type=2&max-keys=" + std::to_string(max_keys);
  q += "&prefix=" + uri_encode(prefix, false);
  return q;
}

ListPage parse_list_page(const std::string& xml) {
  ListPage page;
  bool url_encoded = false;
  bool saw_root = false;
  std::string truncated;
  S3Object current;
  std::string error = walk_xml(xml, [&](const std::string& path, const std::string& text) {
    if (path == "ListBucketResult") {
      saw_root = true;
    } else if (path == "ListBucketResult/Contents/Key") {
      current.key = text;
    } else if (path == "ListBucketResult/Contents/Size") {
      current.size = std::strtoull(text.c_str(), nullptr, 10);
    } else if (path == "ListBucketResult/Contents/ETag") {
      current.etag = strip_quotes(text);
    } else if (path == "ListBucketResult/Contents") {
      page.objects.push_back(std::move(current));
      current = S3Object{};
    } else if (path == "ListBucketResult/IsTruncated") {
      truncated = text;
    } else if (path == "ListBucketResult/NextContinuationToken") {
      page.next_continuation_token = text;
    } else if (path == "ListBucketResult/EncodingType") {
      url_encoded = text == "url";
    }
  });
  if (!error.empty()) {
    throw S3Error(S3Error::Kind::kProtocol, 200, "",
                  "ListObjectsV2 answer is not valid XML (" + error + "); is the endpoint an S3 server?");
  }
  if (!saw_root) {
    throw S3Error(S3Error::Kind::kProtocol, 200, "",
                  "ListObjectsV2 answer has no <ListBucketResult>; is the endpoint an S3 server?");
  }
  page.is_truncated = truncated == "true";
  if (url_encoded) {
    for (S3Object& o : page.objects) o.key = url_decode(o.key);
  }
  if (page.is_truncated && page.next_continuation_token.empty()) {
    throw S3Error(S3Error::Kind::kProtocol, 200, "",
                  "ListObjectsV2 answer says IsTruncated but has no NextContinuationToken");
  }
  return page;
}

ErrorBody parse_error_body(const std::string& xml) {
  ErrorBody body;
  walk_xml(xml, [&](const std::string& path, const std::string& text) {
    if (path == "Error/Code") body.code = text;
    if (path == "Error/Message") body.message = text;
  });
  return body;
}

}  // namespace chorus::data::s3_detail
