// Datasets described by a CSV file: one row per item, a path column, label columns and an optional
// group column; and a train/validation split that keeps every group on one side.
//
//   chorus::data::CsvDatasetOptions o;
//   o.label_columns = {"cat", "dog", "bird"};   // several 0/1 columns: multi-label
//   o.group_column = "patient";
//   auto all = chorus::data::make_csv_dataset("labels.csv", source, decode, o);
//   auto [train, val] = chorus::data::grouped_split(all, 0.2, /*seed=*/0);
//
// The CSV is RFC 4180: fields separated by commas, records by CRLF or LF, a field in double quotes
// may hold commas, line breaks and "" (one quote); a UTF-8 byte order mark is dropped; blank lines
// are skipped. The first record is the header; every record must have as many fields as it.
// Targets: with one label column, an integer class index >= 0 (a 0-dim int64 target); with
// several, each must be 0 or 1 (a float vector target, one element per column, in the order of
// label_columns). Paths are keys of the dataset's ByteSource and are not checked when the CSV is
// read (that would cost one request per item on an object store): a missing file is an error of
// that item when it is loaded, naming the file (or skipped and counted, LoaderOptions::skip_bad).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chorus/data/byte_source.h"
#include "chorus/data/image_dataset.h"

namespace chorus::data {

struct CsvRecord {
  int64_t line = 0;  // 1-based line of the file where the record starts
  std::vector<std::string> fields;
};

// Pure RFC 4180 parser. `where` names the file in errors: DataError "where:line:column: ..." for a
// quote left open, or a character after a closing quote other than a comma or a line break.
std::vector<CsvRecord> parse_csv(const std::string& text, const std::string& where);

struct CsvDatasetOptions {
  std::string path_column = "path";
  std::vector<std::string> label_columns = {"label"};  // one: class index; several: 0/1 multi-label
  std::string group_column;                            // "": no groups
};

// From CSV text (pure apart from the ImageDataset it builds); `where` names the file in errors.
// Throws DataError: an empty CSV or one without rows; a record with the wrong number of fields
// (where:line); a missing column (naming it and listing the columns found); a bad label value
// (where:line:column, the column's name and the value); an empty path. UsageError for options
// without label columns.
ImageDataset make_csv_dataset_from_text(const std::string& text, const std::string& where,
                                        std::shared_ptr<ByteSource> source, DecodeFn decode,
                                        const CsvDatasetOptions& options = {});
// The same from a local CSV file (DataError naming it when it cannot be read).
ImageDataset make_csv_dataset(const std::string& csv_path, std::shared_ptr<ByteSource> source, DecodeFn decode,
                              const CsvDatasetOptions& options = {});
// The same with the CSV read from the source itself, as its key `csv_key` (e.g. a bucket holding
// train.csv beside the images: open_source("s3://b/xrays/") and "train.csv"). Errors name
// source->describe(csv_key).
ImageDataset make_csv_dataset(std::shared_ptr<ByteSource> source, const std::string& csv_key, DecodeFn decode,
                              const CsvDatasetOptions& options = {});

struct DatasetSplit {
  ImageDataset train;
  ImageDataset val;
};

// Splits by group so that no group has items on both sides. Items with an empty group (no group
// column) are each their own group. Deterministic: the named groups sorted by name, then the
// ungrouped items in dataset order, are permuted by torch.randperm(number_of_groups) from a CPU
// generator seeded with `seed` (Python:
// torch.randperm(G, generator=torch.Generator().manual_seed(seed))); groups go to val in that
// order while val holds fewer than round(val_fraction * size) items; the rest go to train. Both
// keep the dataset's item order. The result depends only on the samples and the seed, not on
// threads or ranks, so every rank computes the same split. UsageError unless 0 <= val_fraction <= 1.
DatasetSplit grouped_split(const ImageDataset& dataset, double val_fraction, uint64_t seed);

}  // namespace chorus::data
