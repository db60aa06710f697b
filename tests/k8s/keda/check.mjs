// Validates KEDA ScaledObjects against KEDA's schema: reads a JSON array of objects on stdin, prints a JSON
// array with, per object, its schema errors (empty when valid). The schema is KEDA's CRD compiled by
// @kubernetes-models/keda, installed next to this file's copy by scripts/fetch-keda-schema.sh.
import { readFileSync } from "node:fs";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";

const objects = JSON.parse(readFileSync(0, "utf8"));
const results = objects.map((obj) => {
  try {
    new ScaledObject(obj).validate();
    return [];
  } catch (error) {
    return (error.errors ?? [{ instancePath: "", message: error.message }]).map(
      (e) => `${e.instancePath || "/"}: ${e.message}`,
    );
  }
});
process.stdout.write(JSON.stringify(results));
