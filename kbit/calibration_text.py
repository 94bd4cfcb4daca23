"""kbit's built-in calibration text, and token ids from it (``calibration_tokens``).

Used when ``kbit.quantize_model`` (``method="gptq"``, a bit budget or tuning) is given no calibration data, and
mixed into the user's text when calibration is given as text (``calibration="..."``, the CLI's ``--calibration
FILE``) or as a list of short texts (``calibration=["...", ...]``, for sentence encoders); token ids and model
inputs are used as given. The text was
written for kbit and is released with it under the package's license: short pieces of many kinds -- narrative
and expository prose, dialogue, instructions, lists, tables and numbers, markdown, source code in several
languages, configuration files, and a few paragraphs in other languages -- so that a layer's input statistics
are not those of one kind of text. Mixing it with the user's own text (``calibration_tokens(tok, text)``) keeps
some of that variety when the user's text is narrow: on SmolLM2 calibrated with 1024 tokens of markdown and code
and evaluated on prose, K=3 gptq +rotate goes from 1.079x of the perplexity that calibration on prose gives to
1.046x (docs/QUALITY.md).
"""

from __future__ import annotations

import random
from typing import Optional

import torch

__all__ = ["CALIBRATION_TEXT", "calibration_tokens", "calibration_batches", "builtin_lines", "vocabulary_sentences",
           "default_calibration", "is_text"]

_PIECES = (
    # narrative prose
    """The ferry left the harbour a little after six, when the fog was still lying low over the water. Mara stood
at the rail with her coat buttoned to the chin and watched the town shrink into a row of grey roofs. She had
meant to leave for years, and now that she was leaving she found she could not remember why it had seemed so
urgent. A gull followed the boat for a while, then gave up and turned back toward the fish market.""",
    # expository prose
    """A bicycle stays upright mostly because of steering, not because of the spinning wheels. When the bike
begins to lean, the front wheel turns into the lean and moves the point of contact back under the rider's
centre of mass. The geometry of the fork makes this happen on its own at moderate speeds, which is why a
riderless bicycle pushed down a gentle slope can travel surprisingly far before it falls.""",
    # dialogue
    """"Did you lock the back door?"
"I think so. Why?"
"Because the cat is in the garden, and the cat was inside ten minutes ago."
"Maybe she used the window."
"We don't have a window she can reach. Go and check, please."
"Fine. But if the door is locked, you are making the tea.\"""",
    # instructions
    """How to repot a houseplant:
1. Water the plant a day before, so the roots slide out in one piece.
2. Choose a pot one size larger, with a hole in the bottom.
3. Put a layer of fresh soil in the new pot.
4. Turn the old pot on its side and ease the plant out; loosen circling roots with your fingers.
5. Set the plant at the same depth as before, fill around it and press the soil down gently.
6. Water until it drains, then keep it out of direct sun for a week.""",
    # list and numbers
    """Shopping list for Saturday: 2 kg potatoes, 500 g butter, 12 eggs, 3 lemons, 1 loaf of rye bread,
olive oil (750 ml), coffee beans, 6 apples, a bag of rice (1.5 kg), washing-up liquid.
Budget: 45.80 EUR. Spent last week: 52.15 EUR. Difference: -6.35 EUR.
Train times: 07:42, 08:12, 08:42, then every 30 minutes until 19:12; Sundays 09:05 and 17:35 only.""",
    # table in markdown
    """| city | population (millions) | founded | average July temperature |
|---|---:|---:|---:|
| Lisbon | 0.55 | 1200 BC | 23.5 C |
| Osaka | 2.75 | 645 | 28.1 C |
| Nairobi | 4.40 | 1899 | 17.8 C |
| Montreal | 1.76 | 1642 | 21.2 C |""",
    # markdown document
    """# Release notes

## Version 2.3.0

### Added
- A `--dry-run` flag that prints the planned changes without writing anything.
- Support for reading settings from `~/.config/tool/settings.toml`.

### Fixed
- Paths with spaces are now quoted correctly on Windows.
- The progress bar no longer flickers when the output is redirected to a file.

> **Note:** the old `--quiet` option still works but will be removed in 3.0; use `--log-level error`.""",
    # python
    '''def moving_average(values, window=3):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    total, out = 0.0, []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name: str, count: int = 1) -> None:
        self.items[name] = self.items.get(name, 0) + count

    def __repr__(self):
        return f"Inventory({self.items!r})"''',
    # javascript
    """async function fetchUser(id) {
  const response = await fetch(`/api/users/${id}`);
  if (!response.ok) {
    throw new Error(`request failed with status ${response.status}`);
  }
  const user = await response.json();
  return { ...user, fullName: `${user.first} ${user.last}` };
}

document.querySelectorAll("button.delete").forEach((button) => {
  button.addEventListener("click", () => button.closest("li").remove());
});""",
    # C and SQL
    """#include <stdio.h>

static int gcd(int a, int b) {
    while (b != 0) {
        int t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int main(void) {
    printf("%d\\n", gcd(1071, 462));  /* prints 21 */
    return 0;
}

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= DATE '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY spent DESC
LIMIT 10;""",
    # shell and configuration
    """$ mkdir -p build && cd build
$ cmake .. -DCMAKE_BUILD_TYPE=Release
$ make -j8 2>&1 | tee build.log
$ ./run_tests --filter "parser.*"

# settings.yaml
server:
  host: 0.0.0.0
  port: 8080
  workers: 4
logging:
  level: info
  file: /var/log/app.log
features: [search, export, "dark-mode"]

{"id": 1842, "name": "sensor-7", "readings": [12.5, 12.7, 13.1], "active": true, "tags": null}""",
    # a letter
    """Dear Ms. Okafor,

Thank you for your letter of 14 March. I am sorry to hear that the replacement part arrived damaged. We have
sent a new one by courier today (tracking number 7734-1190-52); it should reach you by Thursday. There is no
need to return the broken part. Please let me know if anything else is wrong.

Kind regards,
Tomas Lindqvist
Customer Service""",
    # question and answer
    """Q: Why does my bread come out dense?
A: Usually the dough did not rise long enough, or the yeast was old. Test the yeast in warm water with a pinch
of sugar: it should foam within ten minutes. Also check the flour; bread flour has more protein than cake flour
and gives a lighter loaf.

Q: Can I freeze it?
A: Yes. Slice it first, wrap it well, and toast the slices straight from the freezer.""",
    # mathematics
    """Let f(x) = x^2 - 4x + 3. Then f(x) = (x - 1)(x - 3), so f has roots at x = 1 and x = 3, and its minimum is at
x = 2, where f(2) = -1. The derivative is f'(x) = 2x - 4, and the area under f between 0 and 1 is
1/3 - 2 + 3 = 4/3. In general, a quadratic ax^2 + bx + c has its vertex at x = -b / (2a).""",
    # news style
    """Heavy rain closed three roads in the northern valley on Tuesday, and about 1,200 homes were without power
for several hours. The regional weather service said 85 millimetres fell in 24 hours, the most for that date
since records began in 1951. Schools are expected to reopen on Wednesday.""",
    # other languages
    """Le marché ouvre à sept heures. Les premiers clients arrivent avant que les marchands aient fini d'installer
leurs étals : ils veulent les meilleures tomates et le pain encore chaud.

Am Wochenende fahren wir mit dem Fahrrad an den See. Wenn das Wetter gut bleibt, nehmen wir das Zelt mit und
übernachten am Ufer.

La biblioteca del barrio amplió su horario: ahora abre de lunes a sábado, de nueve de la mañana a ocho de la
noche, y presta también herramientas y juegos de mesa.

O trem atrasou vinte minutos, mas ninguém reclamou; a paisagem da serra compensava a espera.

今日は朝から雨が降っていたので、家で本を読んで過ごしました。

我们明天早上八点在图书馆门口见面，然后一起去博物馆。

Сегодня вечером мы будем готовить суп из свёклы и капусты.""",
    # poem-like text
    """Morning, and the kettle sings;
the window fogs, the radio hums.
Somewhere a door, somewhere a bell,
and the long grey street begins.""",
    # log lines
    """2024-05-02 10:14:03 INFO  worker-3 started job 5521 (queue=default, attempts=1)
2024-05-02 10:14:07 WARN  worker-3 slow response from db-2: 1840 ms
2024-05-02 10:14:09 ERROR worker-3 job 5521 failed: TimeoutError('connection reset by peer')
2024-05-02 10:14:09 INFO  scheduler retrying job 5521 in 30 s""",
)

CALIBRATION_TEXT = "\n\n".join(_PIECES)


SEQ_LEN = 256  # tokens per calibration sequence
TEXT_SEQUENCES = 32  # at most this many sequences of the user's text (8192 tokens)
BUILTIN_SEQUENCES = 16  # sequences of the built-in text alone (no user text)
MIXED_BUILTIN_SEQUENCES = 12  # and beside a user's text: 3072 tokens, a quarter of 8192 or most of a short text's


def calibration_tokens(tokenizer, text: Optional[str] = None, builtin_sequences: Optional[int] = None,
                       seq_len: int = SEQ_LEN, text_sequences: int = TEXT_SEQUENCES) -> torch.Tensor:
    """Token ids [n_seq, seq_len] for calibration: the user's ``text`` with kbit's built-in ``CALIBRATION_TEXT``.

    ``text`` is cut into consecutive sequences, at most ``text_sequences`` of them (a text shorter than one
    sequence is repeated to fill one); ``builtin_sequences`` sequences (default: ``MIXED_BUILTIN_SEQUENCES`` beside
    a text, ``BUILTIN_SEQUENCES`` without one; 0: the text alone) are cut from the built-in text, repeated as
    needed. A fixed amount of varied text beside the user's keeps calibration on narrow text (a few pages of
    markdown and code, say) from fitting the layers to that kind of text only (docs/QUALITY.md), while a long
    text still makes most of the data. The sequences of the two sources alternate while both last.
    """
    n_builtin = (BUILTIN_SEQUENCES if text is None else MIXED_BUILTIN_SEQUENCES) if builtin_sequences is None \
        else builtin_sequences
    if not isinstance(n_builtin, int) or isinstance(n_builtin, bool) or n_builtin < 0:
        raise ValueError(f"builtin_sequences must be an int >= 0, got {builtin_sequences!r}")
    if text is None and n_builtin == 0:
        raise ValueError("builtin_sequences=0 needs a text: there would be no calibration data")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if seq_len < 2 or text_sequences < 1:
        raise ValueError(f"seq_len must be >= 2 and text_sequences >= 1, got seq_len={seq_len}, "
                         f"text_sequences={text_sequences}")

    def token_ids(source: str, what: str) -> torch.Tensor:
        ids = torch.as_tensor(tokenizer(source, return_tensors="pt")["input_ids"][0], dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError(f"{what} gives no tokens")
        return ids

    def cut(ids: torch.Tensor, n: int) -> list:
        ids = ids.repeat(-(-n * seq_len // ids.numel()))
        return list(ids[:n * seq_len].reshape(n, seq_len))

    user = []
    if text is not None:
        ids = token_ids(text, "the calibration text")
        user = cut(ids, min(text_sequences, max(1, ids.numel() // seq_len)))
    builtin = cut(token_ids(CALIBRATION_TEXT, "the built-in text"), n_builtin) if n_builtin else []
    mixed = [s for pair in zip(user, builtin) for s in pair] + user[len(builtin):] + builtin[len(user):]
    return torch.stack(mixed)


def is_text(calibration) -> bool:
    """Whether ``calibration`` is text to tokenize (a str, or a non-empty list of str), not token ids or inputs."""
    return isinstance(calibration, str) or (isinstance(calibration, (list, tuple)) and bool(calibration)
                                            and all(isinstance(t, str) for t in calibration))


def builtin_lines(min_chars: int = 20) -> list:
    """The built-in text's lines of at least ``min_chars`` characters: short texts of every kind it holds."""
    return [line.strip() for line in CALIBRATION_TEXT.split("\n") if len(line.strip()) >= min_chars]


TEXTS_BATCH = 64  # texts per calibration batch of a list of texts
# Sentences of random vocabulary words beside a list of texts: a layer's Hessian only knows the directions of the
# tokens calibration shows it (MiniLM K=3: calibrated on the evaluated sentences with their words shuffled, 0.9818;
# on other everyday sentences 0.9723; with these beside them 0.9749).
VOCABULARY_SENTENCES = 240
WORDS_PER_SENTENCE = 8


def vocabulary_sentences(tokenizer, n: int = VOCABULARY_SENTENCES, seed: int = 0) -> list:
    """``n`` pseudo-sentences ("The w1 ... w8.") of distinct words drawn (seeded) from the tokenizer's vocabulary:
    the tokens that read as a whole ASCII word of 3 or more letters. Empty when the vocabulary has too few."""
    tokens = sorted(tokenizer.get_vocab())
    words = sorted({w for w in (tokenizer.convert_tokens_to_string([t]).strip() for t in tokens)
                    if len(w) >= 3 and w.isascii() and w.isalpha()})
    if len(words) < WORDS_PER_SENTENCE:
        return []
    rng = random.Random(seed)
    return ["The " + " ".join(rng.sample(words, WORDS_PER_SENTENCE)) + "." for _ in range(n)]


def calibration_batches(tokenizer, texts, builtin: bool = True, batch_size: int = TEXTS_BATCH) -> list:
    """Model inputs (dicts of a padded batch, as the tokenizer gives them) for calibration on short ``texts``
    (sentences, passages), each batch of at most ``batch_size`` texts; with ``builtin``, the built-in text's lines
    (``builtin_lines``) and ``vocabulary_sentences`` as more batches beside them. For models that read short texts
    (sentence encoders), which long windows of ``calibration_tokens`` would show positions and lengths they never
    see."""
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not texts \
            or not all(isinstance(t, str) and t for t in texts):
        raise TypeError("texts must be a non-empty list of non-empty str")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")

    def batches(items: list) -> list:
        return [dict(tokenizer(items[i:i + batch_size], padding=True, truncation=True, return_tensors="pt"))
                for i in range(0, len(items), batch_size)]

    user = batches(list(texts))
    extra = batches(builtin_lines()) + batches(vocabulary_sentences(tokenizer)) if builtin else []
    return [b for pair in zip(user, extra) for b in pair] + user[len(extra):] + extra[len(user):]


def default_calibration(model, tokenizer=None, text=None):
    """Calibration from kbit's built-in text, beside the user's ``text`` when one is given: a str gives
    ``calibration_tokens(tokenizer, text)``, a list of str ``calibration_batches(tokenizer, text)``; ``tokenizer``
    defaults to the transformers tokenizer saved with ``model`` (``model.config._name_or_path``). Raises
    ValueError when there is none."""
    if tokenizer is None:
        path = getattr(getattr(model, "config", None), "_name_or_path", None)
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # no transformers, no path, no tokenizer files there, ...
            what = "calibration text needs a tokenizer" if text is not None else \
                "no calibration was given, and kbit's built-in calibration text needs a tokenizer"
            raise ValueError(
                f"{what}: none was passed and none loads from the model's path {path!r} ({type(e).__name__}); pass "
                f"calibration= as token ids [n_seq, seq_len], or tokenizer=") from None
    return calibration_batches(tokenizer, text) if isinstance(text, (list, tuple)) else calibration_tokens(tokenizer, text)
