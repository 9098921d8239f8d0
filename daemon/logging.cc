#include "daemon/logging.h"

#include <memory>
#include <string>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace kvtier {
namespace {

// %* : the message, escaped for a JSON string.
class JsonEscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    static constexpr char kHex[] = "0123456789abcdef";
    for (char c : std::string_view(msg.payload.data(), msg.payload.size())) {
      switch (c) {
        case '"': dest.append(std::string_view("\\\"")); break;
        case '\\': dest.append(std::string_view("\\\\")); break;
        case '\n': dest.append(std::string_view("\\n")); break;
        case '\t': dest.append(std::string_view("\\t")); break;
        case '\r': dest.append(std::string_view("\\r")); break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            const char esc[] = {'\\', 'u', '0', '0', kHex[(c >> 4) & 0xf], kHex[c & 0xf]};
            dest.append(esc, esc + sizeof(esc));
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonEscapedMessage>();
  }
};

spdlog::level::level_enum ToSpd(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return spdlog::level::trace;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kCritical: return spdlog::level::critical;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

}  // namespace

void SetupLogging(LogFormat format, LogLevel level) {
  auto logger = std::make_shared<spdlog::logger>("kvtierd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  if (format == LogFormat::kJson) {
    formatter->add_flag<JsonEscapedMessage>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","pid":%P,"msg":"%*"})");
  } else {
    formatter->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%-5l%$ kvtierd[%P] %v");
  }
  logger->set_formatter(std::move(formatter));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
  SetLogLevel(level);
}

void SetLogLevel(LogLevel level) { spdlog::set_level(ToSpd(level)); }

}  // namespace kvtier
