// Starts `ppdsl lsp` for .ppspec files. Everything else (diagnostics, hover, completion,
// definition) is the server's; this file only finds the executable and passes the settings.
"use strict";

const vscode = require("vscode");
const { LanguageClient, TransportKind } = require("vscode-languageclient/node");

let client;

function command() {
  const configured = vscode.workspace.getConfiguration("ppdsl").get("command") || "ppdsl";
  const folder = vscode.workspace.workspaceFolders?.[0]?.uri.fsPath ?? "";
  return configured.replace(/\$\{workspaceFolder\}/g, folder);
}

function activate(context) {
  const settings = vscode.workspace.getConfiguration("ppdsl");
  const serverOptions = { command: command(), args: ["lsp"], transport: TransportKind.stdio };
  const clientOptions = {
    documentSelector: [{ language: "ppspec" }],
    initializationOptions: { model: settings.get("modelFeatures", true) },
  };
  client = new LanguageClient("ppdsl", "ppdsl lsp", serverOptions, clientOptions);
  context.subscriptions.push(client);
  return client.start();
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
