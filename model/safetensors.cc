#include "model/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>

#include "common/atomic_file.h"

namespace xd {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swaps");

namespace {

// The reference implementation refuses larger headers; so do we, before parsing.
constexpr uint64_t kMaxHeaderSize = 100'000'000;

struct DtypeDesc {
  Dtype dtype;
  const char* name;
  size_t size;
};
constexpr DtypeDesc kDtypes[] = {
    {Dtype::kF64, "F64", 8}, {Dtype::kF32, "F32", 4}, {Dtype::kF16, "F16", 2},
    {Dtype::kBF16, "BF16", 2}, {Dtype::kI64, "I64", 8}, {Dtype::kI32, "I32", 4},
    {Dtype::kI16, "I16", 2}, {Dtype::kI8, "I8", 1}, {Dtype::kU8, "U8", 1},
    {Dtype::kBool, "BOOL", 1},
};

// kDtypes is indexed by the enumerator value.
const DtypeDesc& desc(Dtype d) {
  const size_t i = static_cast<size_t>(d);
  XD_CHECK(i < std::size(kDtypes) && kDtypes[i].dtype == d);
  return kDtypes[i];
}

// numel * elem_size with overflow detection; a hostile header can claim anything.
bool checked_nbytes(const std::vector<int64_t>& shape, size_t elem_size, size_t* out) {
  size_t n = elem_size;
  for (int64_t s : shape) {
    if (s < 0 || __builtin_mul_overflow(n, static_cast<size_t>(s), &n)) return false;
  }
  *out = n;
  return true;
}

float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {
    // Subnormal half: renormalise into a normal float.
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

template <typename Src>
void convert(const void* src, size_t n, float* out, float (*cvt)(Src)) {
  const unsigned char* p = static_cast<const unsigned char*>(src);
  for (size_t i = 0; i < n; ++i) {
    Src v;
    std::memcpy(&v, p + i * sizeof(Src), sizeof(Src));  // the data may be unaligned
    out[i] = cvt(v);
  }
}

// Parses one tensor's header entry; `where` prefixes every message.
Status parse_tensor_info(const nlohmann::json& j, const std::string& where, TensorInfo* t) {
  if (!j.is_object()) return Status::corruption(where + ": entry is not a JSON object");
  auto dt = j.find("dtype");
  if (dt == j.end() || !dt->is_string())
    return Status::corruption(where + ": missing or non-string \"dtype\"");
  Expected<Dtype> dtype = parse_dtype(dt->get<std::string>());
  if (!dtype) return dtype.status().with_context(where);
  t->dtype = *dtype;

  auto sh = j.find("shape");
  if (sh == j.end() || !sh->is_array())
    return Status::corruption(where + ": missing or non-array \"shape\"");
  for (const nlohmann::json& d : *sh) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      return Status::corruption(where + ": \"shape\" holds " + d.dump() +
                                ", not a non-negative integer");
    t->shape.push_back(d.get<int64_t>());
  }

  auto off = j.find("data_offsets");
  if (off == j.end() || !off->is_array() || off->size() != 2 ||
      !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
    return Status::corruption(where + ": \"data_offsets\" must be [begin, end] of "
                              "non-negative integers");
  uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
  if (b > e) return Status::corruption(where + ": data_offsets begin > end");
  t->begin = b;
  t->end = e;
  return Status::ok();
}

}  // namespace

const char* dtype_name(Dtype d) { return desc(d).name; }
size_t dtype_size(Dtype d) { return desc(d).size; }

Expected<Dtype> parse_dtype(const std::string& name) {
  for (const DtypeDesc& x : kDtypes)
    if (name == x.name) return x.dtype;
  return Status::corruption("unsupported dtype \"" + name + "\"");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t TensorInfo::numel() const {
  // Unsigned: beside a zero dimension the others may multiply past INT64_MAX.
  uint64_t n = 1;
  for (int64_t s : shape) n *= static_cast<uint64_t>(s);
  return static_cast<int64_t>(n);
}

Status write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  const std::string where = "writing " + path;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<ConstBuffer> pieces(2);  // length and header go first
  std::set<std::string> seen;
  size_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    const std::string what = where + ": tensor \"" + t.name + "\"";
    if (t.name.empty() || t.name == "__metadata__")
      return Status::invalid_argument(what + ": reserved or empty name");
    if (!seen.insert(t.name).second) return Status::invalid_argument(what + ": duplicate name");
    size_t nbytes = 0;
    if (!checked_nbytes(t.shape, dtype_size(t.dtype), &nbytes))
      return Status::invalid_argument(what + ": invalid shape " + shape_string(t.shape));
    if (nbytes > 0 && t.data == nullptr) return Status::invalid_argument(what + ": null data");
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    pieces.push_back({t.data, nbytes});
    offset += nbytes;
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // e.g. a name that is not UTF-8
    return Status::invalid_argument(where + ": cannot encode header: " + e.what());
  }
  // Pad so the data buffer starts 8-byte aligned within the file.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t n = text.size();  // stored little-endian; the host is little-endian
  pieces[0] = {&n, sizeof(n)};
  pieces[1] = {text.data(), text.size()};
  return write_file_atomic(path, pieces);
}

Expected<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  Expected<std::string> bytes = read_file(path);
  if (!bytes) return bytes.status().with_context("reading safetensors");
  return parse(std::move(bytes).value(), path);
}

Expected<SafetensorsFile> SafetensorsFile::parse(std::string bytes, const std::string& path) {
  const size_t file_size = bytes.size();
  if (file_size < 8)
    return Status::corruption(path + ": truncated, " + std::to_string(file_size) +
                              " bytes is shorter than the 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > kMaxHeaderSize)
    return Status::corruption(path + ": header length " + std::to_string(n) + " exceeds the " +
                              std::to_string(kMaxHeaderSize) + "-byte limit");
  if (n > file_size - 8)
    return Status::corruption(path + ": truncated, header length " + std::to_string(n) +
                              " exceeds the " + std::to_string(file_size - 8) +
                              " bytes after the length field");

  // Detects duplicate top-level keys, which plain parsing would silently merge.
  std::string duplicate;
  std::set<std::string> keys;
  nlohmann::json::parser_callback_t on_event =
      [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
        if (depth == 1 && ev == nlohmann::json::parse_event_t::key &&
            !keys.insert(parsed.get<std::string>()).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
        return true;
      };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + n, on_event);
  } catch (const nlohmann::json::exception& e) {
    return Status::corruption(path + ": bad header JSON: " + e.what());
  }
  if (!header.is_object()) return Status::corruption(path + ": header JSON is not an object");
  if (!duplicate.empty())
    return Status::corruption(path + ": header names \"" + duplicate + "\" twice");

  SafetensorsFile f;
  f.path_ = path;
  const size_t data_start = 8 + n;
  const size_t buffer_size = file_size - data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object())
        return Status::corruption(path + ": \"__metadata__\" is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          return Status::corruption(path + ": metadata \"" + m.key() + "\" is not a string");
        f.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const std::string where = path + ": tensor \"" + it.key() + "\"";
    TensorInfo t;
    t.name = it.key();
    XD_RETURN_IF_ERROR(parse_tensor_info(*it, where, &t));
    size_t expect = 0;
    if (!checked_nbytes(t.shape, dtype_size(t.dtype), &expect) || expect != t.nbytes())
      return Status::corruption(where + ": data_offsets span " + std::to_string(t.nbytes()) +
                                " bytes but " + dtype_name(t.dtype) + " " +
                                shape_string(t.shape) + " needs " + std::to_string(expect));
    if (t.end > buffer_size)
      return Status::corruption(where + ": data_offsets end " + std::to_string(t.end) +
                                " is past the " + std::to_string(buffer_size) +
                                "-byte data buffer (file truncated?)");
    f.tensors_.push_back(std::move(t));
  }

  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const TensorInfo* prev = nullptr;  // the non-empty tensor reaching furthest so far
  for (const TensorInfo& t : f.tensors_) {
    if (t.nbytes() == 0) continue;
    if (prev && t.begin < prev->end)
      return Status::corruption(path + ": tensors \"" + prev->name + "\" and \"" + t.name +
                                "\" overlap in the data buffer");
    prev = &t;
  }

  auto shared = std::make_shared<const std::string>(std::move(bytes));
  const char* data = shared->data() + data_start;
  for (size_t i = 0; i < f.tensors_.size(); ++i) {
    f.tensors_[i].data = data + f.tensors_[i].begin;
    f.index_[f.tensors_[i].name] = i;
  }
  f.bytes_ = std::move(shared);
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const TensorInfo& t : tensors_) out.push_back(t.name);
  return out;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Status SafetensorsFile::read_f32(const std::string& name,
                                 const std::vector<int64_t>& expected_shape, float* out) const {
  const TensorInfo* t = find(name);
  if (!t) return Status::not_found(path_ + ": no tensor \"" + name + "\"");
  if (t->shape != expected_shape)
    return Status::invalid_argument(path_ + ": tensor \"" + name + "\" has shape " +
                                    shape_string(t->shape) + ", expected " +
                                    shape_string(expected_shape));
  const size_t n = static_cast<size_t>(t->numel());
  switch (t->dtype) {
    case Dtype::kF32:
      if (n) std::memcpy(out, t->data, n * sizeof(float));
      return Status::ok();
    case Dtype::kF64:
      convert<double>(t->data, n, out, [](double v) { return static_cast<float>(v); });
      return Status::ok();
    case Dtype::kBF16:
      convert<uint16_t>(t->data, n, out, bf16_to_float);
      return Status::ok();
    case Dtype::kF16:
      convert<uint16_t>(t->data, n, out, f16_to_float);
      return Status::ok();
    default:
      return Status::invalid_argument(path_ + ": tensor \"" + name + "\" has dtype " +
                                      dtype_name(t->dtype) + ", not a floating-point type");
  }
}

}  // namespace xd
