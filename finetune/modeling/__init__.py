"""Models (layer 3, beside the run directory): the one model and tokenizer loader (`models`), the tiny
model builder (`tiny`), the collator of packed rows (`collator`) and the chunked loss (`chunked_loss`).
Every stage that touches weights goes through here."""
