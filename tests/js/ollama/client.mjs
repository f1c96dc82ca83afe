// The official ollama JavaScript client against a live trioserve: argv[2] is its URL,
// argv[3] its model, argv[4] the API key. Prints one JSON object: what the client read.
import { Ollama } from 'ollama'

const [, , host, model, key] = process.argv
const ollama = new Ollama({ host, headers: { Authorization: `Bearer ${key}` } })
const options = { temperature: 0, num_predict: 24 }
const messages = [{ role: 'user', content: 'Why is the sky blue? Answer in one sentence.' }]

const parts = []
let last = null
for await (const part of await ollama.chat({ model, messages, options, stream: true })) {
  parts.push(part.message.content)
  last = part
}
const whole = await ollama.chat({ model, messages, options })
const generated = await ollama.generate({ model, prompt: 'Once upon a time', options, raw: true })
const streamed = []
for await (const part of await ollama.generate({ model, prompt: 'Once upon a time', options, raw: true, stream: true })) {
  streamed.push(part.response)
}
let error = null
try {
  await ollama.chat({ model: 'no-such-model', messages })
} catch (caught) {
  error = { name: caught.name, status: caught.status_code, message: caught.error }
}
console.log(JSON.stringify({
  chunks: parts.length,
  streamed: parts.join(''),
  last,
  whole: whole.message.content,
  done_reason: whole.done_reason,
  generated: generated.response,
  generated_streamed: streamed.join(''),
  error,
}))
