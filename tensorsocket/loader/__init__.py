"""What tensorsocket reads from the user's loader: its shape (loader_info), its description
(fingerprint) and its workers' heap."""
