"""Independent references for the built-in tasks' tests (no project code)."""
import re


def solve_recurrence_prompt(prompt: str, far_every: int, key_letters: int = 2) -> list[str]:
    """recurrence_trace's rule applied to the prompt's own table and start digits, line by line
    until the terminal look-up (a key missing from the table raises KeyError). One-letter keys:
    the letter of (the last two digits + the line index's tens digit) mod 20."""
    table = dict(re.findall(r"(?:^|;)([a-z]{%d})=([0-9#])(?=;)" % key_letters, prompt))
    a, b = re.search(r"start (\d)(\d)\n$", prompt).groups()
    vals, lines, i = [int(a), int(b)], [f"00:{a}", f"01:{b}"], 2
    while True:
        if i % 100 % far_every == 0:
            if key_letters == 1:
                key = "abcdefghijklmnopqrst"[(vals[-1] + vals[-2] + i % 100 // 10) % 20]
            else:
                key = "abcdefghij"[vals[-1]] + "abcdefghij"[vals[-2]]
            lines.append(f"{i % 100:02d}:{key}={table[key]}")
            if table[key] == "#":
                return lines
            vals.append(int(table[key]))
        else:
            vals.append((vals[-1] + vals[-2]) % 10)
            lines.append(f"{i % 100:02d}:{vals[-1]}")
        i += 1
