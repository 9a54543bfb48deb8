#include "model/corpus.h"

#include <array>
#include <cmath>
#include <string_view>

#include "common/check.h"

namespace xd {
namespace {

// Integer-only RNG and helpers: the corpus must be bit-identical everywhere, which
// rules out std:: distributions (implementation-defined) and floating point. For
// the same reason no expression below makes two RNG calls whose relative order
// the language leaves unspecified (e.g. both operands of +).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {  // splitmix64
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Modulo bias is < 2^-50 for the tiny ranges used here; irrelevant for text.
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
  int between(int lo, int hi) { return lo + below(hi - lo + 1); }  // inclusive
  bool percent(int p) { return below(100) < p; }
  // Skewed towards the front of a list (roughly Zipf-like), as in natural text:
  // the product of two uniforms concentrates near 0.
  int skewed(int n) {
    const int first = below(n);  // separate statements: operand order is unspecified
    return first * below(n) / n;
  }

 private:
  uint64_t state_;
};

template <size_t N>
std::string_view pick(Rng& rng, const std::array<std::string_view, N>& words) {
  return words[rng.below(static_cast<int>(N))];
}
template <size_t N>
std::string_view pick_skewed(Rng& rng, const std::array<std::string_view, N>& words) {
  return words[rng.skewed(static_cast<int>(N))];
}

// ---- (a) prose: a small grammar over ~200 words -------------------------------

constexpr std::array<std::string_view, 9> kDeterminers = {
    "the", "a", "this", "that", "every", "one", "my", "our", "her"};
constexpr std::array<std::string_view, 36> kAdjectives = {
    "old", "young", "small", "big", "red", "green", "quiet", "happy", "tired", "brave",
    "little", "bright", "dark", "cold", "warm", "tall", "slow", "quick", "gentle", "angry",
    "clever", "lazy", "strange", "famous", "empty", "heavy", "soft", "wild", "proud", "kind",
    "ancient", "eager", "honest", "odd", "icy", "orange"};
constexpr std::array<std::string_view, 60> kNouns = {
    "cat", "dog", "farmer", "river", "house", "teacher", "bird", "child", "king", "garden",
    "ship", "mountain", "baker", "window", "horse", "forest", "doctor", "letter", "road", "city",
    "girl", "boy", "friend", "stone", "lamp", "table", "song", "village", "wolf", "sailor",
    "tree", "bridge", "book", "queen", "fox", "painter", "market", "clock", "boat", "field",
    "apple", "owl", "engineer", "island", "umbrella", "artist", "egg", "elephant", "uncle",
    "hill", "hat", "door", "cup", "rabbit", "soldier", "tower", "cloud", "wheel", "coat",
    "candle"};
constexpr std::array<std::string_view, 36> kTransitiveVerbs = {
    "saw", "found", "liked", "carried", "painted", "followed", "helped", "watched", "built",
    "opened", "wanted", "visited", "pushed", "chased", "remembered", "sold", "bought", "fixed",
    "cleaned", "called", "lost", "kept", "drew", "met", "held", "taught", "moved", "loved",
    "feared", "greeted", "noticed", "needed", "washed", "counted", "dropped", "hid"};
constexpr std::array<std::string_view, 16> kIntransitiveVerbs = {
    "slept", "ran", "laughed", "waited", "sang", "smiled", "walked", "jumped", "cried",
    "danced", "rested", "shouted", "worked", "fell", "swam", "left"};
constexpr std::array<std::string_view, 14> kAdverbs = {
    "slowly", "quickly", "quietly", "happily", "again", "today", "often", "soon",
    "carefully", "loudly", "early", "late", "together", "alone"};
constexpr std::array<std::string_view, 11> kPrepositions = {
    "near", "under", "behind", "beside", "above", "inside", "across", "around", "with",
    "before", "after"};
constexpr std::array<std::string_view, 14> kNames = {
    "Anna", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Iris", "Jonas",
    "Kira", "Leo", "Mira", "Noah"};
constexpr std::array<std::string_view, 5> kConjunctions = {"and", "but", "because", "so",
                                                           "while"};

bool starts_with_vowel(std::string_view word) {
  return std::string_view("aeiou").find(word.front()) != std::string_view::npos;
}

void append_noun_phrase(Rng& rng, std::string& out) {
  if (rng.percent(20)) {
    out += pick(rng, kNames);
    return;
  }
  std::string_view det = pick_skewed(rng, kDeterminers);
  std::string_view adjective = rng.percent(45) ? pick_skewed(rng, kAdjectives) : "";
  std::string_view noun = pick_skewed(rng, kNouns);
  std::string_view next_word = adjective.empty() ? noun : adjective;
  // The a/an rule: a small agreement a model can only learn by looking ahead.
  out += (det == "a" && starts_with_vowel(next_word)) ? "an" : det;
  out += ' ';
  if (!adjective.empty()) (out += adjective) += ' ';
  out += noun;
}

void append_clause(Rng& rng, std::string& out) {
  append_noun_phrase(rng, out);
  out += ' ';
  if (rng.percent(65)) {
    out += pick_skewed(rng, kTransitiveVerbs);
    out += ' ';
    append_noun_phrase(rng, out);
  } else {
    out += pick_skewed(rng, kIntransitiveVerbs);
    if (rng.percent(50)) (out += ' ') += pick(rng, kAdverbs);
  }
  if (rng.percent(35)) {
    (out += ' ') += pick(rng, kPrepositions);
    out += ' ';
    append_noun_phrase(rng, out);
  }
}

void append_prose(Rng& rng, std::string& out) {
  const int sentences = rng.between(3, 7);
  for (int s = 0; s < sentences; ++s) {
    if (s > 0) out += ' ';
    const size_t start = out.size();
    append_clause(rng, out);
    if (rng.percent(30)) {
      (out += ", ") += pick(rng, kConjunctions);
      out += ' ';
      append_clause(rng, out);
    }
    if (out[start] >= 'a' && out[start] <= 'z') out[start] = static_cast<char>(out[start] - 32);
    out += rng.percent(85) ? '.' : '!';
  }
  out += '\n';
}

// ---- (b) arithmetic: always-correct facts, some as multiplication tables ------

void append_arithmetic(Rng& rng, std::string& out) {
  if (rng.percent(30)) {
    const int base = rng.between(2, 12);
    for (int i = 1; i <= 10; ++i) {
      out += std::to_string(base) + "*" + std::to_string(i) + "=" + std::to_string(base * i) + "\n";
    }
    return;
  }
  const int lines = rng.between(6, 12);
  for (int i = 0; i < lines; ++i) {
    const int kind = rng.below(3);
    const int a = rng.below(kind == 2 ? 13 : 100);
    const int b = rng.below(kind == 0 ? 100 : kind == 1 ? a + 1 : 13);  // a-b stays >= 0
    const char op = "+-*"[kind];
    const int result = kind == 0 ? a + b : kind == 1 ? a - b : a * b;
    out += std::to_string(a) + op + std::to_string(b) + "=" + std::to_string(result) + "\n";
  }
}

// ---- (c) code: a tiny C-like language; only declared variables are used ------

constexpr std::array<std::string_view, 12> kFunctionVerbs = {
    "get", "set", "count", "find", "sum", "scale", "check", "update", "load", "merge",
    "clamp", "step"};
constexpr std::array<std::string_view, 12> kFunctionNouns = {
    "total", "index", "value", "size", "limit", "score", "items", "node", "level", "speed",
    "offset", "delta"};
constexpr std::array<std::string_view, 10> kVariableNames = {
    "x", "y", "n", "i", "acc", "tmp", "count", "total", "step", "k"};
constexpr std::array<std::string_view, 4> kArithmeticOps = {"+", "-", "*", "/"};
constexpr std::array<std::string_view, 5> kComparisons = {"<", ">", "==", "!=", "<="};

struct CodeWriter {
  Rng& rng;
  std::string& out;
  std::vector<std::string_view> variables;

  void indent(int depth) { out.append(static_cast<size_t>(depth) * 2, ' '); }
  void operand() {
    if (rng.percent(65)) out += variables[rng.below(static_cast<int>(variables.size()))];
    else out += std::to_string(rng.below(20));
  }
  void expression() {
    operand();
    if (rng.percent(70)) {
      (out += ' ') += pick(rng, kArithmeticOps);
      out += ' ';
      operand();
    }
  }
  void statement(int depth) {
    const int kind = rng.below(depth < 3 ? 6 : 3);
    indent(depth);
    if (kind == 0) {
      std::string_view fresh = pick(rng, kVariableNames);
      out += "let ";
      out += fresh;
      out += " = ";
      expression();
      out += ";\n";
      variables.push_back(fresh);
    } else if (kind == 1) {
      out += variables[rng.below(static_cast<int>(variables.size()))];
      out += " = ";
      expression();
      out += ";\n";
    } else if (kind == 2) {
      out += "print(";
      expression();
      out += ");\n";
    } else {
      out += kind == 5 ? "while (" : "if (";
      operand();
      (out += ' ') += pick(rng, kComparisons);
      out += ' ';
      operand();
      out += ") {\n";
      block(depth + 1);
      indent(depth);
      if (kind == 4) {
        out += "} else {\n";
        block(depth + 1);
        indent(depth);
      }
      out += "}\n";
    }
  }
  void block(int depth) {
    // Variables declared inside a block go out of scope at its closing brace.
    const size_t scope = variables.size();
    const int statements = rng.between(1, 3);
    for (int s = 0; s < statements; ++s) statement(depth);
    if (rng.percent(25)) {
      indent(depth);
      out += "return ";
      expression();
      out += ";\n";
    }
    variables.resize(scope);
  }
};

void append_code(Rng& rng, std::string& out) {
  CodeWriter writer{rng, out, {}};
  const int params = rng.between(1, 3);
  out += "fn ";
  out += pick(rng, kFunctionVerbs);
  out += '_';
  out += pick(rng, kFunctionNouns);
  out += '(';
  for (int p = 0; p < params; ++p) {
    if (p > 0) out += ", ";
    writer.variables.push_back(kVariableNames[p * 3]);  // x, i, total: always distinct
    out += writer.variables.back();
  }
  out += ") {\n";
  const int statements = rng.between(2, 5);
  for (int s = 0; s < statements; ++s) writer.statement(1);
  writer.indent(1);
  out += "return ";
  writer.expression();
  out += ";\n}\n";
}

// ---- (d) records: repeated field names, ids that count up ---------------------

constexpr std::array<std::string_view, 16> kPersonNames = {
    "alice", "bob", "carol", "dave", "erin", "frank", "gina", "henry", "ivy", "jack",
    "kate", "liam", "maya", "nick", "olga", "paul"};
constexpr std::array<std::string_view, 10> kCities = {
    "paris", "oslo", "lima", "tokyo", "cairo", "berlin", "madrid", "delhi", "quito", "rome"};
constexpr std::array<std::string_view, 5> kRoles = {"admin", "user", "guest", "editor",
                                                    "owner"};

void append_records(Rng& rng, std::string& out) {
  const int lines = rng.between(4, 8);
  int id = rng.between(1000, 9000);
  const bool json = rng.percent(60);
  for (int i = 0; i < lines; ++i, ++id) {
    const std::string name(pick(rng, kPersonNames));
    const std::string age = std::to_string(rng.between(18, 80));
    const std::string city(pick(rng, kCities));
    if (json) {
      const std::string whole = std::to_string(rng.between(0, 99));
      const std::string score = whole + "." + std::to_string(rng.below(10));
      out += "{\"id\": " + std::to_string(id) + ", \"name\": \"" + name + "\", \"age\": " + age +
             ", \"city\": \"" + city + "\", \"score\": " + score +
             ", \"active\": " + (rng.percent(70) ? "true" : "false") + "}\n";
    } else {
      out += "id=" + std::to_string(id) + "; user=" + name + "; role=" +
             std::string(pick(rng, kRoles)) + "; age=" + age + "; city=" + city + "\n";
    }
  }
}

// ---- (e) DNA: a per-paragraph motif repeated with rare point mutations --------

void append_dna(Rng& rng, std::string& out) {
  static constexpr char kBases[] = "ACGT";
  std::string motif(static_cast<size_t>(rng.between(4, 12)), 'A');
  for (char& base : motif) base = kBases[rng.below(4)];
  out += ">seq" + std::to_string(rng.between(1, 999)) + "\n";
  const int lines = rng.between(3, 6);
  size_t at = 0;
  for (int line = 0; line < lines; ++line) {
    for (int column = 0; column < 60; ++column, ++at) {
      out += rng.percent(4) ? kBases[rng.below(4)] : motif[at % motif.size()];
    }
    out += '\n';
  }
}

}  // namespace

std::string builtin_corpus(uint64_t seed, size_t bytes) {
  Rng rng(seed);
  std::string out;
  out.reserve(bytes + 4096);
  using Domain = void (*)(Rng&, std::string&);
  constexpr std::array<Domain, 5> kDomains = {append_prose, append_arithmetic, append_code,
                                              append_records, append_dna};
  while (out.size() < bytes) {
    kDomains[static_cast<size_t>(rng.below(static_cast<int>(kDomains.size())))](rng, out);
    out += '\n';  // blank line between paragraphs
  }
  out.resize(bytes);
  return out;
}

double unigram_entropy_nats(const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return 0.0;
  std::vector<uint64_t> counts;
  for (int32_t t : tokens) {
    XD_CHECK_MSG(t >= 0, "unigram_entropy_nats: negative token id");
    if (static_cast<size_t>(t) >= counts.size()) counts.resize(static_cast<size_t>(t) + 1, 0);
    ++counts[static_cast<size_t>(t)];
  }
  const double total = static_cast<double>(tokens.size());
  double entropy = 0.0;
  for (uint64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / total;
    entropy -= p * std::log(p);
  }
  return entropy;
}

}  // namespace xd
