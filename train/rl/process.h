#pragma once
// Child programs of the RL trainer (issue 15): the --reward-cmd program
// (rewards.h) and the --agent-cmd agents (agent.h) share this.
//
// spawn_shell runs `/bin/sh -c CMD` in its own process group, with stdin and
// stdout (and stderr when asked) on non-blocking pipes, default signal
// dispositions, an empty signal mask and none of our other descriptors.
// kill_and_reap sends SIGKILL to the whole group (the shell's children too)
// and reaps the shell. Writing to a pipe whose reader is gone is EPIPE under
// a SigpipeBlock, never SIGPIPE.
#include <signal.h>
#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace areno::train::rl {

// Seconds on the steady clock.
double now_s();

// poll() on one descriptor until `deadline` (now_s() time); the revents, or 0
// at the deadline.
short poll_until(int fd, short events, double deadline);

// Blocks SIGPIPE in this thread for its lifetime, so that writing to a pipe
// whose reader is gone fails with EPIPE; a SIGPIPE raised meanwhile is
// consumed (unless one was already pending before).
class SigpipeBlock {
 public:
  SigpipeBlock();
  ~SigpipeBlock();
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;

 private:
  sigset_t set_, old_;
  bool was_pending_ = false;
};

struct ChildProcess {
  pid_t pid = -1;
  int in = -1;   // our end of its stdin (write)
  int out = -1;  // our end of its stdout (read)
  int err = -1;  // our end of its stderr (read), when captured
  bool running() const { return pid > 0; }
};

struct SpawnOptions {
  std::vector<std::string> env;  // "NAME=value" added to (or replacing in) our environment
  bool capture_stderr = false;   // false: the child's stderr is ours
};

// Throws std::runtime_error("<what>: ...") when a pipe or /bin/sh cannot be made.
ChildProcess spawn_shell(const std::string& cmd, const SpawnOptions& options, const std::string& what);

// Waits up to `grace_s` for `pid` to end without reaping it; its status (as
// waitid reports it) when it ended.
std::optional<siginfo_t> wait_ended(pid_t pid, double grace_s);

// "exited with status 3", "exited with status 127 (127: the shell did not find
// the command)", "was killed by signal 9 (Killed)".
std::string describe_end(const siginfo_t& si);

// SIGKILL to the child's group and the child, reaps it, closes our pipe ends.
void kill_and_reap(ChildProcess& c);

// Bytes of a child's output as an error message shows them: at most `max`
// bytes, control and non-ASCII bytes as \xHH.
std::string shown(std::string_view s, size_t max = 200);

}  // namespace areno::train::rl
