// CSV datasets (RFC 4180) and the grouped train/validation split.
#include "chorus/data/csv_dataset.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

namespace chorus::data {
namespace {

std::string position(const std::string& where, int64_t line, int64_t column) {
  return where + ":" + std::to_string(line) + ":" + std::to_string(column);
}

}  // namespace

std::vector<CsvRecord> parse_csv(const std::string& text, const std::string& where) {
  std::vector<CsvRecord> records;
  size_t i = text.compare(0, 3, "\xEF\xBB\xBF") == 0 ? 3 : 0;  // byte order mark
  int64_t line = 1;
  size_t line_start = i;
  const size_t n = text.size();
  while (i < n) {
    // A blank line (LF or CRLF alone) is no record.
    if (text[i] == '\n' || (text[i] == '\r' && i + 1 < n && text[i + 1] == '\n')) {
      i += text[i] == '\r' ? 2 : 1;
      ++line;
      line_start = i;
      continue;
    }
    CsvRecord record;
    record.line = line;
    while (true) {  // one field per iteration
      std::string field;
      if (i < n && text[i] == '"') {
        const int64_t open_line = line;
        const size_t open_column = i - line_start + 1;
        ++i;
        while (true) {
          if (i >= n) {
            throw DataError(position(where, open_line, static_cast<int64_t>(open_column)) +
                            ": the quoted field opened here is never closed (a double quote inside a quoted field "
                            "is written as two: \"\")");
          }
          if (text[i] == '"') {
            if (i + 1 < n && text[i + 1] == '"') {
              field += '"';
              i += 2;
              continue;
            }
            ++i;
            break;
          }
          if (text[i] == '\n') {
            ++line;
            line_start = i + 1;
          }
          field += text[i++];
        }
        if (i < n && text[i] != ',' && text[i] != '\n' && !(text[i] == '\r' && i + 1 < n && text[i + 1] == '\n') &&
            !(text[i] == '\r' && i + 1 == n)) {
          throw DataError(position(where, line, static_cast<int64_t>(i - line_start + 1)) + ": unexpected '" +
                          printable(std::string(1, text[i])) + "' after the closing quote of a field");
        }
      } else {
        while (i < n && text[i] != ',' && text[i] != '\n' && !(text[i] == '\r' && (i + 1 == n || text[i + 1] == '\n'))) {
          field += text[i++];
        }
      }
      record.fields.push_back(std::move(field));
      if (i < n && text[i] == ',') {
        ++i;
        continue;
      }
      // End of the record: CRLF, LF, or the end of the text.
      if (i < n && text[i] == '\r') ++i;
      if (i < n && text[i] == '\n') {
        ++i;
        ++line;
        line_start = i;
      }
      break;
    }
    records.push_back(std::move(record));
  }
  return records;
}

ImageDataset make_csv_dataset_from_text(const std::string& text, const std::string& where,
                                        std::shared_ptr<ByteSource> source, DecodeFn decode,
                                        const CsvDatasetOptions& options) {
  if (options.label_columns.empty()) throw UsageError("make_csv_dataset: CsvDatasetOptions::label_columns is empty");
  const auto records = parse_csv(text, where);
  if (records.empty()) throw DataError(where + ": the CSV is empty; it needs a header row and one row per item");
  const auto& header = records.front().fields;
  std::string found;
  // The header as a message shows it: escaped (it may be any bytes), at most 32 columns.
  constexpr size_t kColumnsShown = 32;
  for (size_t c = 0; c < header.size() && c < kColumnsShown; ++c) {
    found += (c ? ", " : "") + ("'" + printable(header[c], 64) + "'");
  }
  if (header.size() > kColumnsShown) found += ", ... (" + std::to_string(header.size()) + " columns)";
  auto column = [&](const std::string& name, const char* role) {
    for (size_t c = 0; c < header.size(); ++c) {
      if (header[c] == name) return c;
    }
    throw DataError(where + ": no column '" + printable(name) + "' (the " + role + " column) in the header; the columns are " +
                    found);
  };
  const size_t path_col = column(options.path_column, "path");
  std::vector<size_t> label_cols;
  for (const auto& name : options.label_columns) label_cols.push_back(column(name, "label"));
  const bool grouped = !options.group_column.empty();
  const size_t group_col = grouped ? column(options.group_column, "group") : 0;
  if (records.size() == 1) throw DataError(where + ": the CSV has a header but no rows");

  const bool multi = label_cols.size() > 1;
  std::vector<ImageSample> samples;
  samples.reserve(records.size() - 1);
  for (size_t r = 1; r < records.size(); ++r) {
    const auto& rec = records[r];
    if (rec.fields.size() != header.size()) {
      throw DataError(where + ":" + std::to_string(rec.line) + ": " + std::to_string(rec.fields.size()) +
                      " fields where the header has " + std::to_string(header.size()));
    }
    ImageSample s;
    s.key = rec.fields[path_col];
    if (s.key.empty()) {
      throw DataError(position(where, rec.line, static_cast<int64_t>(path_col) + 1) + ": empty path in column '" +
                      printable(options.path_column) + "'");
    }
    for (size_t c : label_cols) {
      const std::string& v = rec.fields[c];
      int64_t value = -1;
      const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
      const bool integer = ec == std::errc() && end == v.data() + v.size() && !v.empty();
      if (multi ? !(integer && (value == 0 || value == 1)) : !(integer && value >= 0)) {
        throw DataError(position(where, rec.line, static_cast<int64_t>(c) + 1) + ": bad label value '" + printable(v) +
                        "' in column '" + printable(header[c]) + "': expected " +
                        (multi ? "0 or 1 (one of several label columns: multi-label)" : "a class index (an integer >= 0)"));
      }
      if (multi) {
        s.labels.push_back(static_cast<float>(value));
      } else {
        s.label = value;
      }
    }
    if (grouped) s.group = rec.fields[group_col];
    samples.push_back(std::move(s));
  }
  return ImageDataset(std::move(source), std::move(samples), std::move(decode),
                      multi ? options.label_columns : std::vector<std::string>{});
}

ImageDataset make_csv_dataset(const std::string& csv_path, std::shared_ptr<ByteSource> source, DecodeFn decode,
                              const CsvDatasetOptions& options) {
  std::ifstream in(csv_path, std::ios::binary);
  if (!in) throw DataError(csv_path + ": cannot open the CSV file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw DataError(csv_path + ": cannot read the CSV file");
  return make_csv_dataset_from_text(text.str(), csv_path, std::move(source), std::move(decode), options);
}

ImageDataset make_csv_dataset(std::shared_ptr<ByteSource> source, const std::string& csv_key, DecodeFn decode,
                              const CsvDatasetOptions& options) {
  if (!source) throw UsageError("make_csv_dataset: the ByteSource is null");
  const std::vector<uint8_t> bytes = source->read(csv_key);
  const std::string where = source->describe(csv_key);  // before `source` is moved
  return make_csv_dataset_from_text(std::string(bytes.begin(), bytes.end()), where, std::move(source),
                                    std::move(decode), options);
}

DatasetSplit grouped_split(const ImageDataset& dataset, double val_fraction, uint64_t seed) {
  if (!(val_fraction >= 0.0 && val_fraction <= 1.0)) {
    throw UsageError("grouped_split: val_fraction must be in [0, 1], got " + std::to_string(val_fraction));
  }
  // Distinct groups sorted by name; an item without a group is a group of its own (by position).
  std::map<std::string, std::vector<size_t>> named;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < dataset.size(); ++i) {
    const auto& g = dataset.sample(i).group;
    if (g.empty()) continue;
    named[g].push_back(i);
  }
  for (auto& [name, items] : named) groups.push_back(std::move(items));
  for (size_t i = 0; i < dataset.size(); ++i) {
    if (dataset.sample(i).group.empty()) groups.push_back({i});
  }
  const auto target = static_cast<size_t>(std::llround(val_fraction * static_cast<double>(dataset.size())));
  std::vector<bool> in_val(dataset.size(), false);
  if (!groups.empty()) {
    const at::Tensor perm = at::randperm(static_cast<int64_t>(groups.size()), at::detail::createCPUGenerator(seed),
                                         at::TensorOptions().dtype(at::kLong));
    const int64_t* order = perm.data_ptr<int64_t>();
    size_t val_items = 0;
    for (size_t k = 0; k < groups.size() && val_items < target; ++k) {
      for (size_t i : groups[static_cast<size_t>(order[k])]) in_val[i] = true;
      val_items += groups[static_cast<size_t>(order[k])].size();
    }
  }
  std::vector<size_t> train, val;
  for (size_t i = 0; i < dataset.size(); ++i) (in_val[i] ? val : train).push_back(i);
  return {dataset.subset(train), dataset.subset(val)};
}

}  // namespace chorus::data
