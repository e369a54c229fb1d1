"""A helper process the tests talk to one line at a time: it prints one JSON
line of facts, answers each command with a line, and exits on "quit"."""

import json
import subprocess


class LinePeer:
    def __init__(self, argv, **popen):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("%s exited before saying hello (status %s)" % (argv[-2:], self.proc.wait(30)))
        self.hello = json.loads(line)

    def ask(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self):
        """Ask it to quit; its exit status."""
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        return self.proc.wait(timeout=60)
