#include "tools/options.h"

#include <cerrno>
#include <cstdlib>

namespace hcomm::tools {

namespace {

// A whole decimal (or floating) number in [lo, hi]; nothing else.
bool parse_num(const std::string& s, double lo, double hi, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno != 0 || !(v >= lo && v <= hi)) return false;
  *out = v;
  return true;
}

bool parse_int(const std::string& s, int lo, int hi, int* out) {
  double v;
  if (!parse_num(s, lo, hi, &v) || v != static_cast<int>(v)) return false;
  *out = static_cast<int>(v);
  return true;
}

}  // namespace

Parsed parse_run_args(const std::vector<std::string>& args, RunOptions* out, std::string* why) {
  RunOptions o;
  size_t i = 0;
  auto fail = [&](std::string w) {
    *why = std::move(w);
    return Parsed::usage_error;
  };
  // The option's value, or null when the command line ends first.
  auto value = [&]() -> const std::string* { return i + 1 < args.size() ? &args[++i] : nullptr; };
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    } else if (a == "-n" || a == "--np") {
      const std::string* v = value();
      if (v == nullptr) return fail(a + " needs a value");
      if (!parse_int(*v, 1, 4096, &o.n)) return fail("-n wants an integer in 1..4096");
    } else if (a == "--sim") {
      o.sim = true;
    } else if (a == "--sim-devices") {
      const std::string* v = value();
      if (v == nullptr) return fail(a + " needs a value");
      if (!parse_int(*v, 1, 256, &o.sim_devices)) return fail("--sim-devices wants an integer in 1..256");
    } else if (a == "--timeout") {
      const std::string* v = value();
      if (v == nullptr) return fail(a + " needs a value");
      if (!parse_num(*v, 0.001, 1e7, &o.timeout_s)) return fail("--timeout wants a positive number of seconds");
    } else if (a == "--grace") {
      const std::string* v = value();
      if (v == nullptr) return fail(a + " needs a value");
      if (!parse_num(*v, 0, 1e7, &o.grace_s)) return fail("--grace wants a number of seconds");
    } else if (a == "-h" || a == "--help") {
      return Parsed::help;
    } else if (!a.empty() && a[0] == '-') {
      return fail("unknown option " + a);
    } else {
      break;
    }
  }
  for (; i < args.size(); ++i) o.argv.push_back(args[i]);
  if (o.n == 0) return fail("-n N is required");
  if (o.argv.empty()) return fail("no program given");
  if (o.argv[0].empty()) return fail("the program name is empty");
  *out = std::move(o);
  return Parsed::run;
}

Parsed parse_probe_args(const std::vector<std::string>& args, bool have_rdma, ProbeOptions* out, std::string* why) {
  ProbeOptions o;
  std::vector<std::string> words;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") {
      o.json = true;
    } else if (a == "--sim-dir") {
      if (i + 1 >= args.size()) {
        *why = "--sim-dir needs a directory";
        return Parsed::usage_error;
      }
      o.sim_dir = args[++i];
      if (o.sim_dir.empty()) {
        *why = "--sim-dir needs a directory";
        return Parsed::usage_error;
      }
    } else if (a == "--version") {
      o.command = ProbeOptions::Command::version;
      *out = std::move(o);
      return Parsed::run;
    } else if (a == "-h" || a == "--help") {
      return Parsed::help;
    } else if (a.size() > 1 && a[0] == '-') {
      *why = "unknown option " + a;
      return Parsed::usage_error;
    } else {
      words.push_back(a);
    }
  }
  using C = ProbeOptions::Command;
  if (words.empty()) {
    *why = "no command";
    return Parsed::usage_error;
  }
  const std::string& cmd = words[0];
  if (cmd == "list" && words.size() == 1) {
    o.command = C::list;
  } else if ((cmd == "info" || cmd == "selftest") && words.size() == 2) {
    o.command = cmd == "info" ? C::info : C::selftest;
    o.device = words[1];
  } else if (cmd == "rdma" && words.size() == 1 && have_rdma) {
    o.command = C::rdma;
  } else if (cmd == "list" || cmd == "info" || cmd == "selftest" || (cmd == "rdma" && have_rdma)) {
    *why = "wrong number of arguments to " + cmd;
    return Parsed::usage_error;
  } else {
    *why = "unknown command '" + cmd + "'";
    return Parsed::usage_error;
  }
  *out = std::move(o);
  return Parsed::run;
}

}  // namespace hcomm::tools
