// Files the tools read and write: every error names the file, what it was for and the OS's reason.
#pragma once

#include <fstream>
#include <string>
#include <string_view>

namespace kvc::cli {

// Throws kvc::error (errc::io) "cannot open WHAT 'PATH': REASON".
std::ifstream open_read(const std::string& path, std::string_view what, bool binary = false);
std::ofstream open_write(const std::string& path, std::string_view what);
// Flushes and closes `f`; throws "cannot write WHAT 'PATH': REASON" if any write failed.
void finish_write(std::ofstream& f, const std::string& path, std::string_view what);
void write_file(const std::string& path, std::string_view what, std::string_view bytes);

}  // namespace kvc::cli
