#include "train/rl/process.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

extern char** environ;

namespace areno::train::rl {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

short poll_until(int fd, short events, double deadline) {
  for (;;) {
    const double left = deadline - now_s();
    const int ms = left <= 0 ? 0 : int(std::min(left * 1000.0 + 1.0, 3.6e6));
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, ms);
    if (rc > 0) return p.revents;
    if (rc < 0 && errno != EINTR) return POLLERR;
    if (rc == 0 && ms == 0) return 0;
  }
}

SigpipeBlock::SigpipeBlock() {
  sigemptyset(&set_);
  sigaddset(&set_, SIGPIPE);
  sigset_t pending;
  sigpending(&pending);
  was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  pthread_sigmask(SIG_BLOCK, &set_, &old_);
}

SigpipeBlock::~SigpipeBlock() {
  if (!was_pending_) {
    const timespec zero{0, 0};
    while (sigtimedwait(&set_, nullptr, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_, nullptr);
}

namespace {

// Our environment with `extra` ("NAME=value") added, replacing same names.
std::vector<std::string> merged_env(const std::vector<std::string>& extra) {
  std::vector<std::string> out;
  auto name_of = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const std::string name = name_of(kv);
    if (std::none_of(extra.begin(), extra.end(), [&](const std::string& x) { return name_of(x) == name; }))
      out.push_back(kv);
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

}  // namespace

ChildProcess spawn_shell(const std::string& cmd, const SpawnOptions& options, const std::string& what) {
  // p[0]: its stdin (we write p[0][1]); p[1]: its stdout; p[2]: its stderr.
  int p[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
  auto close_all = [&] {
    for (auto& q : p)
      for (int& fd : q)
        if (fd >= 0) ::close(fd), fd = -1;
  };
  for (int i = 0; i < (options.capture_stderr ? 3 : 2); ++i)
    if (::pipe2(p[i], O_CLOEXEC) != 0) {
      const int e = errno;
      close_all();
      throw std::runtime_error(fmt::format("{}: pipe: {}", what, std::strerror(e)));
    }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[0][0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&fa, p[1][1], STDOUT_FILENO);
  if (options.capture_stderr) posix_spawn_file_actions_adddup2(&fa, p[2][1], STDERR_FILENO);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  posix_spawn_file_actions_addclosefrom_np(&fa, 3);  // descriptors opened without O_CLOEXEC too
#endif
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);  // its own group, so a kill reaches its children too
  sigset_t none, defaults;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  sigemptyset(&defaults);
  for (int s : {SIGPIPE, SIGINT, SIGQUIT, SIGTERM, SIGHUP, SIGCHLD, SIGALRM, SIGUSR1, SIGUSR2}) sigaddset(&defaults, s);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  std::vector<std::string> env = merged_env(options.env);
  std::vector<char*> envp;
  for (std::string& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/bin/sh", &fa, &attr, const_cast<char* const*>(argv),
                             options.env.empty() ? environ : envp.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  ::close(p[0][0]), ::close(p[1][1]);
  p[0][0] = p[1][1] = -1;
  if (p[2][1] >= 0) ::close(p[2][1]), p[2][1] = -1;
  if (rc != 0) {
    close_all();
    throw std::runtime_error(fmt::format("{}: cannot start /bin/sh: {}", what, std::strerror(rc)));
  }
  ChildProcess c;
  c.pid = pid;
  c.in = p[0][1];
  c.out = p[1][0];
  c.err = p[2][0];
  for (int fd : {c.in, c.out, c.err})
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return c;
}

std::optional<siginfo_t> wait_ended(pid_t pid, double grace_s) {
  const double deadline = now_s() + grace_s;
  for (;;) {
    siginfo_t si{};
    si.si_pid = 0;
    if (::waitid(P_PID, id_t(pid), &si, WEXITED | WNOHANG | WNOWAIT) < 0) {
      if (errno == EINTR) continue;
      return std::nullopt;
    }
    if (si.si_pid == pid) return si;
    if (now_s() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string describe_end(const siginfo_t& si) {
  if (si.si_code == CLD_EXITED)
    return fmt::format("exited with status {}{}", si.si_status,
                       si.si_status == 127 ? " (127: the shell did not find the command)" : "");
  return fmt::format("was killed by signal {} ({})", si.si_status, strsignal(si.si_status));
}

void kill_and_reap(ChildProcess& c) {
  if (c.pid > 0) {
    // The group first, while the unreaped leader keeps its id from reuse.
    ::kill(-c.pid, SIGKILL);
    ::kill(c.pid, SIGKILL);
    int status = 0;
    while (::waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  for (int* fd : {&c.in, &c.out, &c.err})
    if (*fd >= 0) ::close(*fd), *fd = -1;
  c.pid = -1;
}

std::string shown(std::string_view s, size_t max) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') out += char(c);
    else out += fmt::format("\\x{:02x}", c);
  }
  if (s.size() > max) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

}  // namespace areno::train::rl
